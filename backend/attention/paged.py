"""What every paged-attention backend does alike; the backends differ only in the cache write and
the decode attention (torch SDPA over gathered blocks, or the CUDA kernel).

One ``forward`` per layer, in this order (an invariant, not a detail):
  1. write every new K/V of the step into its slot (``slot_mapping``; -1 means skip);
  2. attend each sequence's new queries over its whole context, read back from the paged cache.
Writing first matters because a sequence may read blocks that another sequence of the same step
is filling (a prefix-cache hit on blocks computed in this very step).

Decodes come first in the batch (AttentionMetadata): the decode rows are ``query[:num_decodes]``
and go to the backend's ``decode``; every prefill chunk gets one SDPA call here: ``is_causal``
straight on this step's K/V when there is no cached prefix, else an offset causal mask over the
context gathered through the block table (GQA via ``enable_gqa``). Prefill is compute-bound:
torch's fused attention does that work better than a hand-written kernel would, and the gather
costs O(context) memory traffic against O(new tokens x context) compute. Everything that depends
only on the step's metadata (masks, index tensors, the backend's own decode plan) is computed once
per step and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from backend.attention.base import AttentionMetadata
from backend.models.shape import ceil_div


@dataclass(slots=True)
class PrefillSeq:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [num_ctx_blocks] int64; None when there is no cached prefix
    mask: torch.Tensor | None  # [query_len, seq_len] additive float; None when is_causal suffices


@dataclass(slots=True)
class StepPlan:
    """Per-step indices and masks, shared by all layers."""

    metadata: AttentionMetadata  # the step this plan belongs to (compared by identity)
    dtype: torch.dtype
    block_size: int
    prefills: list[PrefillSeq]
    backend: Any  # the backend's own plan for its write and decode (plan_step)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere (every query row keeps >= 1 key)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


class PagedAttentionBackend:
    """What every attention backend is (the models type it as AttentionBackend): forward() here;
    subclasses give write_cache and decode."""

    name = "paged"

    def __init__(self) -> None:
        self._plan: StepPlan | None = None

    # ---- what a backend provides (tensor shapes as in forward below) ------------------------------
    def plan_step(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> Any:
        """The backend's own per-step plan (index tensors, masks), built once a step; None by default."""
        return None

    def write_cache(self, key, value, key_cache, value_cache, metadata: AttentionMetadata, plan: Any) -> None:
        """Writes this step's key/value rows into their slots (``metadata.slot_mapping``, -1 skipped)."""
        raise NotImplementedError

    def decode(self, query, key_cache, value_cache, metadata: AttentionMetadata, plan: Any,
               scale: float) -> torch.Tensor:
        """Attention of the decode rows ``query[:num_decodes]`` ([num_decodes, num_heads, head_size])
        over their contexts; returns the same shape."""
        raise NotImplementedError

    # ---- the shared part --------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        cache_written: bool = False,  # the caller already wrote key/value into their slots
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        self.check_cache(query, key_cache, value_cache)
        plan = self._get_plan(metadata, key_cache.shape[1], query.dtype)
        if not cache_written:
            self.write_cache(key, value, key_cache, value_cache, metadata, plan.backend)
        if query.shape[0] == 0:
            return torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if metadata.decode_only:
            return self.decode(query, key_cache, value_cache, metadata, plan.backend, scale)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self.decode(query[:num_decodes], key_cache, value_cache, metadata, plan.backend,
                                               scale)
        self.prefill(query, key, value, key_cache, value_cache, plan, scale, output)
        return output

    def prefill(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], this step written
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        plan: StepPlan,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size]: the prefill rows are written
    ) -> None:
        """Attention of every prefill chunk (the rows after the decodes): one SDPA call per sequence."""
        group = query.shape[1] // key_cache.shape[2]
        for seq in plan.prefills:
            output[seq.query_start : seq.query_end] = prefill_attention(
                query, key, value, key_cache, value_cache, seq, group, scale)

    def check_cache(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """Raises ValueError when the caches do not fit this backend (the kernels have demands)."""

    def _get_plan(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> StepPlan:
        plan = self._plan
        if plan is not None and plan.metadata is metadata and plan.dtype == dtype and plan.block_size == block_size:
            return plan
        plan = StepPlan(metadata, dtype, block_size, self.plan_prefills(metadata, block_size, dtype),
                        self.plan_step(metadata, block_size, dtype))
        self._plan = plan
        return plan

    def plan_prefills(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[PrefillSeq]:
        """Per prefill sequence, what ``prefill`` needs (masks, context block ids), built once a step."""
        prefills = []
        start = metadata.num_decodes  # one query row per decode, and they come first
        for i in range(metadata.num_decodes, metadata.num_seqs):
            prefills.append(plan_prefill(metadata, i, start, block_size, dtype))
            start += metadata.query_lens_list[i]
        return prefills


def plan_prefill(metadata: AttentionMetadata, i: int, start: int, block_size: int,
                  dtype: torch.dtype) -> PrefillSeq:
    q_len, s_len = metadata.query_lens_list[i], metadata.seq_lens_list[i]
    if s_len == q_len:  # no cached prefix: causal attention over this step's K/V
        return PrefillSeq(start, start + q_len, s_len, None, None)
    device = metadata.block_tables.device
    block_ids = metadata.block_tables[i, : ceil_div(s_len, block_size)].to(torch.int64)
    # query t sits at position s_len - q_len + t and sees keys 0..that position
    q_pos = torch.arange(s_len - q_len, s_len, device=device)
    k_pos = torch.arange(s_len, device=device)
    return PrefillSeq(start, start + q_len, s_len, block_ids, additive_mask(k_pos[None, :] <= q_pos[:, None], dtype))


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]: this step's keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], this step already written
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    seq: PrefillSeq,
    group: int,  # query heads per KV head
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_size]
    """Causal attention of one sequence's new tokens over its whole context."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    # 4-D with a batch of one: on CPU (torch 2.13), 3-D inputs take SDPA's unfused math path
    # (bmm, softmax, masking) where 4-D ones take the much faster flash kernel, GQA included.
    q = query[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_size]
    if seq.block_ids is None:
        k = key[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, q_len, head_size]
        v = value[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        ctx = seq.block_ids.shape[0] * block_size
        k = key_cache.index_select(0, seq.block_ids).view(ctx, num_kv_heads, head_size)
        v = value_cache.index_select(0, seq.block_ids).view(ctx, num_kv_heads, head_size)
        k = k[: seq.seq_len].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, seq_len, head_size]
        v = v[: seq.seq_len].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seq.mask, scale=scale, enable_gqa=group > 1)
    return out[0].transpose(0, 1)
