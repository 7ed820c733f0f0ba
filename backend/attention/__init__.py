"""Attention over the paged KV cache: a backend protocol and its implementations."""

from backend.attention.base import AttentionMetadata
from backend.attention.paged import PagedAttentionBackend as AttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata"]
