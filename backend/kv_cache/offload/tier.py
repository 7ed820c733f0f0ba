"""The tier base (what a stored block is, what a tier must do, the LRU bookkeeping tiers share) and
the host-memory tier.

A tier keeps full prefix blocks by their chained block hash (backend/kv_cache/block_pool.py), with
the tokens and parent hash that identify them, so a load is verified exactly like a pool hit: a
hash is a lookup key, never proof. Tiers are bounded by bytes and evict least recently used first.
Every method may be called from the offloader's threads and the engine's: each tier locks itself.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StoredBlock:
    """One full block's KV with what identifies it."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [num_layers, 2 (key, value), block_size, num_kv_heads, head_size], on the CPU

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def matches(self, parent_hash: int | None, token_ids) -> bool:
        return self.parent_hash == parent_hash and self.token_ids == tuple(token_ids)


class KVTier(ABC):
    """A bounded store of StoredBlocks keyed by block hash.

    The bookkeeping every tier shares is here: ``_entries`` maps each kept block's key to what the
    tier holds for it (least recently used first), ``_used`` counts their bytes, and ``_make_room``
    evicts through the tier's ``_drop``.
    """

    name: str = "tier"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.lock = threading.Lock()
        # Called (under the lock) with the hash of each block the tier drops to make room or as
        # unreadable: KV events tell routers it is gone.
        self.on_removed: Callable[[int], None] | None = None
        self._entries: OrderedDict[int, object] = OrderedDict()
        self._used = 0

    def _removed(self, block_hash: int) -> None:
        if self.on_removed is not None:
            self.on_removed(block_hash)

    def _key(self, block_hash: int) -> int:
        """The key ``block_hash`` is kept under in ``_entries``."""
        return block_hash

    def __contains__(self, block_hash: int) -> bool:
        with self.lock:
            return self._key(block_hash) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    def _make_room(self, size: int) -> None:
        """Drops the least recently used entries until ``size`` more bytes fit (called under the lock)."""
        while self._entries and self._used + size > self.capacity_bytes:
            self._drop(next(iter(self._entries)))

    @abstractmethod
    def _drop(self, key: int) -> None:
        """Forgets entry ``key``: its bytes leave ``_used`` and on_removed hears of it."""

    @abstractmethod
    def store(self, block: StoredBlock) -> bool:
        """Keeps ``block`` (evicting the least recently used to make room); False when it cannot."""

    @abstractmethod
    def load(self, block_hash: int) -> StoredBlock | None:
        """The block stored under ``block_hash`` (now the most recently used), or None."""


class HostMemoryTier(KVTier):
    """Blocks in host memory (pinned beside a CUDA device, so the copies back are DMA)."""

    name = "host"
    _entries: OrderedDict[int, StoredBlock]  # block hash -> the block

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.pin_memory = pin_memory

    def _drop(self, key: int) -> None:
        self._used -= self._entries.pop(key).nbytes
        self._removed(key)

    def store(self, block: StoredBlock) -> bool:
        if block.nbytes > self.capacity_bytes:
            return False
        kv = block.kv.pin_memory() if self.pin_memory and not block.kv.is_pinned() else block.kv
        stored = StoredBlock(block.block_hash, block.parent_hash, tuple(block.token_ids), kv)
        with self.lock:
            old = self._entries.pop(block.block_hash, None)
            if old is not None:
                self._used -= old.nbytes
            self._make_room(stored.nbytes)
            self._entries[block.block_hash] = stored
            self._used += stored.nbytes
        return True

    def load(self, block_hash: int) -> StoredBlock | None:
        with self.lock:
            block = self._entries.get(block_hash)
            if block is not None:
                self._entries.move_to_end(block_hash)
            return block
