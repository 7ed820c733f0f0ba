"""LLM-serving engine for Triton's Python backend: paged KV cache, continuous batching.

The engine (everything here but ``backend.triton``) imports without Triton or CuPy.
"""
