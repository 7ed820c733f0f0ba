"""KV-cache events in vLLM's wire format, gathered while the engine steps.

A router that routes by where the KV already lives (vllm-router's ``kv_aware`` policy, llm-d,
Dynamo) follows each engine's cache from these events: ``BlockStored`` when full blocks become
prefix-cached (in the pool, or written to an offload tier), ``BlockRemoved`` when they stop being
found there, ``AllBlocksCleared`` when the whole prefix cache is forgotten. The structs carry the
same fields, order and tags as vLLM's ``KVEventBatch`` (msgspec: the batch an array of timestamp,
events and data-parallel rank; each event a map tagged with its class name), so any consumer of
vLLM's events reads ours.

A router indexes stored blocks by their token ids and finds them again by hash for removals, so a
hash here only has to be stable and unique within one engine: it is the pool's chained block hash
as an unsigned 64-bit integer. ``medium`` says where the block is: ``GPU`` (vLLM's name for the
engine's own pool, whatever the device), ``CPU`` for the host-memory tier, ``STORAGE`` for the disk
tier; routers credit the slower tiers less.

:class:`KVEventLog` collects events from the engine's thread and the offload writer's thread and
merges neighbours (one ``BlockStored`` per chain of blocks, one ``BlockRemoved`` per run), so a step
publishes one small batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
TIER_MEDIUM = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}  # KVTier.name -> medium

_U64 = (1 << 64) - 1


def external_hash(block_hash: int) -> int:
    """The block hash on the wire: unsigned 64-bit (vLLM's ExternalBlockHash may be an int)."""
    return block_hash & _U64


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; ``tag=True`` writes the class name as the map's ``type``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first one; None at a prompt's start
    token_ids: list[int]  # block_size tokens per block, in order
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventLog:
    """Events since the last :meth:`take`, neighbours merged; safe from any thread."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               medium: str = MEDIUM_GPU) -> None:
        """One full block became findable in ``medium``."""
        block = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        with self._lock:
            last = self._events[-1] if self._events else None
            if (isinstance(last, BlockStored) and last.medium == medium and parent is not None
                    and last.block_hashes[-1] == parent):
                last.block_hashes.append(block)
                last.token_ids.extend(token_ids)
                return
            self._events.append(BlockStored([block], parent, list(token_ids), self.block_size, None, medium, None))

    def removed(self, block_hash: int, medium: str = MEDIUM_GPU) -> None:
        """One block can no longer be found in ``medium``."""
        block = external_hash(block_hash)
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.append(block)
                return
            self._events.append(BlockRemoved([block], medium))

    def cleared(self) -> None:
        """The pool's whole prefix cache is forgotten (earlier events still go out, in order)."""
        with self._lock:
            self._events.append(AllBlocksCleared())

    def take(self) -> KVEventBatch | None:
        """The events so far as one batch (None when there are none); the log starts empty again."""
        with self._lock:
            if not self._events:
                return None
            events, self._events = self._events, []
        return KVEventBatch(time.time(), events, 0)
