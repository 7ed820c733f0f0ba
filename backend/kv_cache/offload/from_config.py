"""Builds the engine's offloader from the cache parameters, with the fingerprint that keeps a
disk tier's files from ever being loaded into another model, dtype, block size or format."""

from __future__ import annotations

import hashlib
import json
import logging
import os

from backend.config import CacheConfig
from backend.kv_cache.offload.block_io import PagedBlockIO
from backend.kv_cache.offload.disk_tier import DiskTier
from backend.kv_cache.offload.offloader import KVOffloader
from backend.kv_cache.offload.tier import HostMemoryTier

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_BYTES = 1 << 30
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "triton-llm", "kv_offload")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def model_fingerprint(model_dir: str, dtype: str, block_size: int, block_shape: tuple[int, ...]) -> str:
    """A hex digest of what the stored KV depends on: the model's config and weight files (names
    and sizes), the KV dtype, the block size and shape, and this file format's version."""
    digest = hashlib.sha256()
    config_path = os.path.join(model_dir, "config.json")
    if os.path.exists(config_path):
        with open(config_path, "rb") as handle:
            digest.update(handle.read())
    weights = sorted((name, os.path.getsize(os.path.join(model_dir, name)))
                     for name in os.listdir(model_dir) if name.endswith(WEIGHT_SUFFIXES))
    digest.update(json.dumps({"weights": weights, "dtype": dtype, "block_size": block_size,
                              "block_shape": list(block_shape), "format": FORMAT_VERSION}).encode())
    return digest.hexdigest()


def build_offloader(cache: CacheConfig, kv_caches, block_size: int, model_dir: str) -> KVOffloader | None:
    """None with ``kv_offload_tier: none``."""
    if cache.kv_offload_tier == "none":
        return None
    block_io = PagedBlockIO(kv_caches)
    capacity = cache.kv_offload_bytes or DEFAULT_BYTES
    if cache.kv_offload_tier == "host":
        tier = HostMemoryTier(capacity, pin_memory=block_io.device.type == "cuda")
    else:
        dtype = str(kv_caches[0][0].dtype).removeprefix("torch.")
        fingerprint = model_fingerprint(model_dir, dtype, block_size, block_io.block_shape)
        tier = DiskTier(cache.kv_offload_dir or DEFAULT_DIR, capacity, fingerprint)
    logger.info("KV offload: %s tier of %.0f MiB (%d KiB per block), load policy %s", tier.name, capacity / 2**20,
                block_io.bytes_per_block // 1024, cache.kv_offload_load_policy)
    return KVOffloader(tier, block_io, block_size, cache.kv_offload_queue_blocks, cache.kv_offload_load_policy)
