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

Sliding-window attention (``forward(..., sliding_window=W)``): the query at position i sees keys
i - W < j <= i (transformers' ``sliding_window_overlay``). A step may mix sliding and global layers,
so plans are kept per window (one per distinct window a step uses, each built once). A window that
no sequence of the step outgrows is full attention and shares its plan. A prefill chunk gathers only
the blocks some query's window reaches, and one longer than the window without a cached prefix gets
a banded mask instead of ``is_causal``; decodes read only their last W positions (the backends).
"""

from __future__ import annotations

from collections.abc import Collection
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
    block_ids: torch.Tensor | None  # [num_ctx_blocks] int64 from block key_start // block_size; None: no prefix
    mask: torch.Tensor | None  # [query_len, seq_len - key_start] additive float; None when is_causal suffices
    key_start: int = 0  # position of the first key attended (a block start; > 0 only with a window)


@dataclass(slots=True)
class StepPlan:
    """Per-step indices and masks, shared by all layers."""

    metadata: AttentionMetadata  # the step this plan belongs to (compared by identity)
    dtype: torch.dtype
    block_size: int
    prefills: list[PrefillSeq]
    backend: Any  # the backend's own plan for its write and decode (plan_step)
    window: int = 0  # sliding window; 0: full causal attention


@dataclass(slots=True)
class _StepPlans:
    """One step's plans, one per (window, dtype, block_size) the layers ask for."""

    metadata: AttentionMetadata  # compared by identity
    plans: dict[tuple[int, torch.dtype, int], StepPlan]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere (every query row keeps >= 1 key)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


class PagedAttentionBackend:
    """What every attention backend is (the models type it as AttentionBackend): forward() here;
    subclasses give write_cache and decode."""

    name = "paged"

    def __init__(self) -> None:
        self._plan: _StepPlans | None = None  # None: plan afresh at the next forward

    # ---- what a backend provides (tensor shapes as in forward below) ------------------------------
    def plan_step(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int = 0) -> Any:
        """The backend's own per-step plan (index tensors, masks) for one sliding ``window`` (0: none),
        built once a step; None by default."""
        return None

    def write_cache(self, key, value, key_cache, value_cache, metadata: AttentionMetadata, plan: Any) -> None:
        """Writes this step's key/value rows into their slots (``metadata.slot_mapping``, -1 skipped)."""
        raise NotImplementedError

    def decode(self, query, key_cache, value_cache, metadata: AttentionMetadata, plan: Any,
               scale: float) -> torch.Tensor:
        """Attention of the decode rows ``query[:num_decodes]`` ([num_decodes, num_heads, head_size])
        over their contexts (the last ``window`` positions of each, with the window ``plan`` was made
        for); returns the same shape."""
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
        sliding_window: int | None = None,  # query i sees keys i - W < j <= i; None or 0: all j <= i
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        self.check_cache(query, key_cache, value_cache)
        plan = self._get_plan(metadata, key_cache.shape[1], query.dtype, effective_window(sliding_window, metadata))
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

    def _get_plan(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int = 0) -> StepPlan:
        plans = self._plan
        if plans is None or plans.metadata is not metadata:
            plans = self._plan = _StepPlans(metadata, {})
        key = (window, dtype, block_size)
        plan = plans.plans.get(key)
        if plan is None:
            plan = StepPlan(metadata, dtype, block_size, self.plan_prefills(metadata, block_size, dtype, window),
                            self.plan_step(metadata, block_size, dtype, window), window)
            plans.plans[key] = plan
        return plan

    def plan_prefills(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype,
                      window: int = 0, seqs: Collection[int] | None = None) -> list[PrefillSeq]:
        """Per prefill sequence (only those in ``seqs`` when given), what ``prefill`` needs (masks,
        context block ids), built once a step."""
        prefills = []
        start = metadata.num_decodes  # one query row per decode, and they come first
        for i in range(metadata.num_decodes, metadata.num_seqs):
            if seqs is None or i in seqs:
                prefills.append(plan_prefill(metadata, i, start, block_size, dtype, window))
            start += metadata.query_lens_list[i]
        return prefills


def effective_window(sliding_window: int | None, metadata: AttentionMetadata) -> int:
    """The window to plan for: 0 (full attention) when none, or when no context of the step outgrows it."""
    if not sliding_window:
        return 0
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    return sliding_window if sliding_window < metadata.max_seq_len else 0


def plan_prefill(metadata: AttentionMetadata, i: int, start: int, block_size: int,
                  dtype: torch.dtype, window: int = 0) -> PrefillSeq:
    q_len, s_len = metadata.query_lens_list[i], metadata.seq_lens_list[i]
    if s_len == q_len and (not window or q_len <= window):  # no cached prefix: causal over this step's K/V
        return PrefillSeq(start, start + q_len, s_len, None, None)
    device = metadata.block_tables.device
    # query t sits at position s_len - q_len + t and sees keys 0..that position (the last `window` of them)
    q_pos = torch.arange(s_len - q_len, s_len, device=device)
    if s_len == q_len:  # no cached prefix, longer than the window: this step's K/V, banded mask
        k_pos = torch.arange(s_len, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        return PrefillSeq(start, start + q_len, s_len, None, additive_mask(allowed, dtype))
    # only the blocks some query's window reaches: from the one holding the first query's first key
    first_block = max(0, s_len - q_len - window + 1) // block_size if window else 0
    block_ids = metadata.block_tables[i, first_block : ceil_div(s_len, block_size)].to(torch.int64)
    key_start = first_block * block_size
    k_pos = torch.arange(key_start, s_len, device=device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return PrefillSeq(start, start + q_len, s_len, block_ids, additive_mask(allowed, dtype), key_start)


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
    """Causal attention of one sequence's new tokens over its context (keys from ``seq.key_start``)."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    # 4-D with a batch of one: on CPU (torch 2.13), 3-D inputs take SDPA's unfused math path
    # (bmm, softmax, masking) where 4-D ones take the much faster flash kernel, GQA included.
    q = query[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_size]
    if seq.block_ids is None:
        k = key[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, q_len, head_size]
        v = value[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)
        if seq.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:  # a sliding window shorter than the chunk
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=seq.mask, scale=scale, enable_gqa=group > 1)
    else:
        ctx = seq.block_ids.shape[0] * block_size
        k = key_cache.index_select(0, seq.block_ids).view(ctx, num_kv_heads, head_size)
        v = value_cache.index_select(0, seq.block_ids).view(ctx, num_kv_heads, head_size)
        keys = seq.seq_len - seq.key_start
        k = k[:keys].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, keys, head_size]
        v = v[:keys].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seq.mask, scale=scale, enable_gqa=group > 1)
    return out[0].transpose(0, 1)
