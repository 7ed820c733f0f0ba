"""The engine: requests, the scheduler, the model runner, sampling and everything after the forward.

``llm_engine.LLMEngine`` is the loop (add, abort, step); ``outputs`` holds what it returns and
imports no torch, so processes that only send responses (Triton's stubs) can read engine outputs
without loading torch. Nothing is imported here, for the same reason.
"""
