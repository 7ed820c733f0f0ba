"""Attention over the paged KV cache: a backend protocol and its implementations."""

from backend.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
