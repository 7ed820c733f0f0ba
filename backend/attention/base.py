"""The per-step metadata every attention backend reads (the backends: backend/attention/paged.py).

KV cache layout (one pair per layer, shared by all backends and the CUDA kernels):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
Block 0 is the null block: block tables are padded with it; nothing real is ever written there.
A token's slot is ``block_id * block_size + offset``; slot -1 means "do not write".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened batch of one engine step (no padding between sequences).

    Decodes come first: sequences ``0 .. num_decodes - 1`` have exactly one new token each (query
    rows ``0 .. num_decodes - 1``), the rest several (prefill chunks). Sequence i owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; ``seq_lens[i]`` is its context length after this
    step (cached prefix + new tokens), so its new tokens sit at positions
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. Build it with :meth:`build`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, padded with 0 (null block)
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_list: list[int]  # host copies, so backends need not synchronise to read them
    query_lens_list: list[int]
    num_decodes: int  # leading sequences with one new token
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
              query_lens: list[int]) -> AttentionMetadata:
        """Metadata on the device of ``block_tables``; raises ValueError unless decodes come first."""
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        if any(q <= 1 for q in query_lens[num_decodes:]):
            raise ValueError(f"sequences with one new token must come first, got query lengths {query_lens}")
        device = block_tables.device
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens_list=list(seq_lens),
            query_lens_list=list(query_lens),
            num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs
