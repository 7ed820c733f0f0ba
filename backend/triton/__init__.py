"""Triton glue: the only package that imports triton_python_backend_utils (lazily, at model load)."""
