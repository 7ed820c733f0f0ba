"""Builds random paged-attention batches for the kernel and backend tests.

Caches start filled with NaN: the null block, unused blocks and the slots past each context stay
NaN, so a kernel that reads one element it should not turns its output into NaN. Block tables are
shuffled (sequences own scattered, non-increasing block ids) and padded with the null block 0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from backend.attention.base import AttentionMetadata
from tests.kernels import reference

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size], prefixes written
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata
    seq_lens: list[int]
    query_lens: list[int]


def make_block_tables(
    seq_lens: list[int], block_size: int, max_blocks: int | None, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Shuffled block tables [num_seqs, max_blocks] int32 padded with 0, and the cache's num_blocks."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    width = max(needed) if max_blocks is None else max_blocks
    num_blocks = sum(needed) + 3  # the null block and two that nobody owns
    ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return tables, num_blocks


def random_like_dtype(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0
):
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    max_blocks: int | None = None,
    query_scale: float = 1.0,
    seed: int = 0,
    fill: float = float("nan"),
) -> Batch:
    """Sequence i has seq_lens[i] context tokens, of which the last query_lens[i] are new this step.

    The cached prefix (seq_lens[i] - query_lens[i] tokens) is written into the cache; the new
    tokens' K/V are returned in key/value with their slots in metadata.slot_mapping. Every other
    cache element is ``fill`` (NaN by default: reading one poisons the output). The batch lists
    the sequences with one new token first (stable), as the model runner does.
    """
    order = sorted(range(len(seq_lens)), key=lambda i: query_lens[i] != 1)
    seq_lens, query_lens = [seq_lens[i] for i in order], [query_lens[i] for i in order]
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = make_block_tables(seq_lens, block_size, max_blocks, g)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, fill, dtype=dtype)  # what no sequence owns stays `fill`
    value_cache = torch.full(shape, fill, dtype=dtype)
    slots, num_tokens = [], sum(query_lens)
    query = random_like_dtype((num_tokens, num_heads, head_size), dtype, g, query_scale)
    key = random_like_dtype((num_tokens, num_kv_heads, head_size), dtype, g)
    value = random_like_dtype((num_tokens, num_kv_heads, head_size), dtype, g)
    for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        positions = range(n)
        for t in positions:
            slot = int(tables[i, t // block_size]) * block_size + t % block_size
            if t < n - q:  # cached prefix
                key_cache.view(-1, num_kv_heads, head_size)[slot] = random_like_dtype(
                    (num_kv_heads, head_size), dtype, g
                )
                value_cache.view(-1, num_kv_heads, head_size)[slot] = random_like_dtype(
                    (num_kv_heads, head_size), dtype, g
                )
            else:
                slots.append(slot)
    metadata = AttentionMetadata.build(torch.tensor(slots, dtype=torch.int64), tables, list(seq_lens), list(query_lens))
    return Batch(query, key, value, key_cache, value_cache, metadata, list(seq_lens), list(query_lens))


def expected_output(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reference attention output [num_tokens, num_heads, head_size] float32, key_cache, value_cache
    after the step's writes), computed without any kernel."""
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    reference.write_cache(batch.key, batch.value, key_cache, value_cache, batch.metadata.slot_mapping)
    out = reference.paged_varlen(
        batch.query,
        key_cache,
        value_cache,
        batch.metadata.block_tables,
        batch.seq_lens,
        batch.query_lens,
        scale,
    )
    return out, key_cache, value_cache


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """A copy of ``batch`` on ``device`` (host lists stay as they are)."""
    md = batch.metadata
    metadata = dataclasses.replace(
        md, slot_mapping=md.slot_mapping.to(device), block_tables=md.block_tables.to(device),
        seq_lens=md.seq_lens.to(device), query_start_loc=md.query_start_loc.to(device),
    )
    move = [t.to(device) for t in (batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache)]
    return Batch(*move, metadata, batch.seq_lens, batch.query_lens)
