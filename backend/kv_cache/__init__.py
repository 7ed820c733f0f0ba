"""Paged KV cache bookkeeping: the block pool (ref counts, LRU free queue, prefix-cache table) and
the per-request manager the scheduler talks to. Pure Python: no tensors live here."""

from backend.kv_cache.block_pool import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)
from backend.kv_cache.manager import KVCacheManager

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "hash_block_tokens",
]
