"""The engine's part in disaggregated serving, from ``kv_role``: a transfer server on a prefill
engine, a puller on a decode engine, nothing on a colocated one (``both``)."""

from __future__ import annotations

from backend.config import KVTransferConfig
from backend.kv_transfer.puller import KVPuller
from backend.kv_transfer.server import KVTransferServer


def attach_kv_transfer(config: KVTransferConfig, kv_cache_manager, kv_caches, block_size: int):
    """Makes the role's piece and hands it to ``kv_cache_manager``; returns it (None for ``both``).
    ``kv_caches``: per layer (key, value), each [num_blocks, block_size, num_kv_heads, head_size]."""
    if config.kv_role == "prefill":
        server = KVTransferServer(config.kv_transfer_endpoint, kv_caches, block_size,
                                  config.kv_transfer_timeout_seconds)
        kv_cache_manager.transfer_server = server
        return server
    if config.kv_role == "decode":
        key = kv_caches[0][0]
        puller = KVPuller(config.peers, (len(kv_caches), 2, *key.shape[1:]), key.dtype,
                          config.kv_transfer_pull_timeout_seconds)
        kv_cache_manager.puller = puller
        return puller
    return None
