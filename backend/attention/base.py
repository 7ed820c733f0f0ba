"""The attention backend protocol and the per-step metadata every backend reads.

KV cache layout (one pair per layer, shared by all backends and the CUDA kernels):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
Block 0 is the null block: block tables are padded with it; nothing real is ever written there.
A token's slot is ``block_id * block_size + offset``; slot -1 means "do not write".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened batch of one engine step (no padding between sequences).

    Sequences are ordered as the scheduler scheduled them; sequence i owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``. ``seq_lens[i]`` is the context length after this
    step (cached prefix + new tokens), so the new tokens sit at positions
    ``seq_lens[i] - num_new[i] .. seq_lens[i] - 1``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, padded with 0 (null block)
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    num_decode_only: bool = False  # True when every sequence has exactly one new token
    # Host copies, so backends need not synchronise to read them.
    seq_lens_list: list[int] | None = None
    query_lens_list: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache and attends the new queries over the context."""

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...
