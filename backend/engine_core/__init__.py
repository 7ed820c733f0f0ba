"""The engine core (scheduler, runner, KV cache, sampler) as a loop, and how the front end reaches it.

``core.EngineCore`` is the serving loop's body around an ``LLMEngine``; ``core_process`` runs it in
a child process. ``engine_client.EngineClient`` is the front end's one interface to it, with three
implementations: ``in_thread`` (a thread of this process), ``process_client`` (its own process,
free-running) and ``step_on_demand`` (one step per call, in its own process or in this one);
``admission`` decides whether a new request is taken (busy, draining). The process clients talk
to the core over ZeroMQ with msgspec messages (``messages``). Nothing here imports Triton, and
nothing the front end imports with the core in its own process imports torch.
"""
