"""The engine core (scheduler, runner, KV cache, sampler) as a loop, and in a process of its own.

``core.EngineCore`` is the serving loop's body around an ``LLMEngine``; ``core_process`` runs it in
a child process; ``client`` (the `llm` model) and ``sync_client`` (the `llm_iterative` model) talk
to that process over ZeroMQ with msgspec messages (``messages``). Nothing here imports Triton.
"""
