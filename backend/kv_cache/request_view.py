"""What the KV cache keeps and reads of one request: its own record (``RequestBlocks``) and a narrow
view of the rest (``CachedSequence``), so the cache never imports the engine's ``Request``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from backend.kv_cache.block_pool import BlockHash
from backend.sequence_view import SequenceView


@dataclass(slots=True)
class RequestBlocks:
    """The KV cache's record of one request; only backend/kv_cache writes it.

    ``hash_root`` is set once, when the request is made: None for the base model, a LoRA adapter's own
    root (backend/lora/manager.py) otherwise, so no cached block is shared across adapters."""

    hash_root: BlockHash | None = None  # what the first block chains to
    block_hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks (tokens never change)
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache (0 again after a free)
    remote_pull_done: bool = False  # a decode engine pulls a prompt's KV from its prefill engine once

    def forked(self) -> RequestBlocks:
        """The record of a fork (a sample or a beam) that shares every block of this one."""
        return RequestBlocks(self.hash_root, list(self.block_hashes), self.num_cached_blocks, self.remote_pull_done)


class CachedSequence(SequenceView, Protocol):
    """What the KV cache reads of a request (the engine's Request, a draft model's shadow sequence);
    of its sampling parameters, prompt_logprobs (no prefix hits) and kv_transfer_params."""

    num_computed_tokens: int  # tokens whose KV is in the cache
    kv: RequestBlocks

    @property
    def is_finished(self) -> bool: ...
