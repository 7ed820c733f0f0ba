"""Llama-family models over the paged KV cache (llama.py), their loader (loader.py) and their
shape facts (shape.py). Nothing is imported here: the attention backends use shape.py, and the
models use the attention backends."""
