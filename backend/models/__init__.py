"""Llama-family models over the paged KV cache, and their loader."""

from backend.models.llama import LlamaForCausalLM
from backend.models.loader import SUPPORTED_ARCHITECTURES, ModelLoadError, load_model, resolve_dtype

__all__ = ["LlamaForCausalLM", "ModelLoadError", "SUPPORTED_ARCHITECTURES", "load_model", "resolve_dtype"]
