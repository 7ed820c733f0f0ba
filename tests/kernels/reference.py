"""Naive torch attention over the paged KV cache: the ground truth for the kernel tests.

Written for clarity, not speed, and independent of every backend: it gathers each sequence's
context token by token through its block table and computes softmax(q k^T * scale) v in float32.
"""

from __future__ import annotations

import torch


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [max_num_blocks_per_seq] int32
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_size] float32
    """The first ``context_len`` tokens of one sequence, in order."""
    block_size = cache.shape[1]
    rows = [cache[int(block_table[t // block_size]), t % block_size] for t in range(context_len)]
    return torch.stack(rows).float()


def attend(
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key: torch.Tensor,  # [context_len, num_kv_heads, head_size]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_size]
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_size] float32
    """Causal attention of the last ``q_len`` positions over the whole context (GQA by repeat)."""
    q_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query.float() * scale, k)
    positions = torch.arange(context_len - q_len, context_len).unsqueeze(1)  # [q_len, 1]
    allowed = torch.arange(context_len).unsqueeze(0) <= positions  # [q_len, context_len]
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_size] float32
    """One new token per sequence attending over its whole context."""
    out = []
    for i, context_len in enumerate(seq_lens.tolist()):
        k = gather_context(key_cache, block_tables[i], context_len)
        v = gather_context(value_cache, block_tables[i], context_len)
        out.append(attend(query[i : i + 1], k, v, scale)[0])
    return torch.stack(out)


def paged_varlen(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size] float32
    """Each sequence's new tokens (the last query_lens[i] positions) attend causally over its context."""
    out, start = [], 0
    for i, (context_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        k = gather_context(key_cache, block_tables[i], context_len)
        v = gather_context(value_cache, block_tables[i], context_len)
        out.append(attend(query[start : start + q_len], k, v, scale))
        start += q_len
    return torch.cat(out)


def write_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """What reshape_and_cache must do."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[t]
            value_cache[slot // block_size, slot % block_size] = value[t]
