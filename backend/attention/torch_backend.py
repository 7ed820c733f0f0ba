"""Paged attention in plain torch: the reference backend on CPU and a fallback on CUDA.

One call per layer does two things, in this order (an invariant, not a detail):
  1. write every new K/V of the step into its slot (``slot_mapping``; -1 means skip);
  2. attend each sequence's new queries over its whole context, read back from the paged cache.
Writing first matters because a sequence may read blocks that another sequence of the same step
is filling (a prefix-cache hit on blocks computed in this very step).

How it is fast on CPU (measured with variants; see the report of the commit that added it):
  * sequences with one new token (decode) are batched into ONE SDPA call: their blocks are
    gathered into a padded ``[num_decode, max_blocks * block_size, num_kv_heads, head_size]``
    tensor, a float mask hides the padding, and GQA is handled by viewing the queries as
    ``[num_decode, num_kv_heads, group, head_size]`` (the group plays the role of query rows,
    so K/V are never repeated);
  * sequences with several new tokens (prefill chunks) get one SDPA call each: ``is_causal``
    straight on this step's K/V when there is no cached prefix, else an explicit offset mask over
    the gathered context; GQA via ``enable_gqa``.
Everything that depends only on the step's metadata (index tensors, masks) is computed once per
step in a plan and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.attention.base import AttentionMetadata


@dataclass(slots=True)
class _PrefillSeq:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [num_ctx_blocks] int64; None when there is no cached prefix
    mask: torch.Tensor | None  # [query_len, seq_len] additive float; None when is_causal suffices


@dataclass(slots=True)
class _StepPlan:
    """Per-step indices and masks, shared by all layers."""

    metadata: AttentionMetadata  # the step this plan belongs to (compared by identity)
    dtype: torch.dtype
    block_size: int
    write_slots: torch.Tensor  # [num_valid] int64 slots to write
    write_rows: torch.Tensor | None  # [num_valid] int64 rows of key/value; None: all rows, in order
    decode_rows: torch.Tensor | None  # [num_decode] int64 query rows; None: every row is a decode
    decode_block_ids: torch.Tensor | None  # [num_decode * max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] additive float
    num_decode: int
    decode_max_blocks: int
    prefills: list[_PrefillSeq]


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere (every query row keeps >= 1 key)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


class TorchAttentionBackend:
    """AttentionBackend in torch ops (SDPA), for any device torch supports."""

    name = "torch"

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self._plan: _StepPlan | None = None

    # ------------------------------------------------------------------ planning (once a step)
    def _get_plan(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _StepPlan:
        plan = self._plan
        if plan is not None and plan.metadata is metadata and plan.dtype == dtype and plan.block_size == block_size:
            return plan
        plan = self._build_plan(metadata, block_size, dtype)
        self._plan = plan
        return plan

    def _build_plan(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _StepPlan:
        device = metadata.slot_mapping.device
        seq_lens = metadata.seq_lens_list
        if seq_lens is None:
            seq_lens = metadata.seq_lens.tolist()
        query_lens = metadata.query_lens_list
        if query_lens is None:
            query_lens = torch.diff(metadata.query_start_loc).tolist()

        slot_mapping = metadata.slot_mapping
        valid = slot_mapping >= 0
        if bool(valid.all()):
            write_slots, write_rows = slot_mapping, None
        else:
            write_rows = valid.nonzero().squeeze(1)
            write_slots = slot_mapping.index_select(0, write_rows)

        decode_idx: list[int] = []
        decode_row_list: list[int] = []
        prefills: list[_PrefillSeq] = []
        start = 0
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if q_len == 1:
                decode_idx.append(i)
                decode_row_list.append(start)
            elif q_len > 1:
                prefills.append(self._plan_prefill(metadata, i, start, q_len, s_len, block_size, dtype))
            start += q_len

        num_decode = len(decode_idx)
        decode_rows = decode_block_ids = decode_mask = None
        decode_max_blocks = 0
        if num_decode:
            max_len = max(seq_lens[i] for i in decode_idx)
            tables = metadata.block_tables
            dec_seq_lens = metadata.seq_lens
            if num_decode != len(query_lens):  # mixed step: select the decode sequences
                seq_sel = torch.tensor(decode_idx, dtype=torch.int64, device=device)
                decode_rows = torch.tensor(decode_row_list, dtype=torch.int64, device=device)
                tables = tables.index_select(0, seq_sel)
                dec_seq_lens = dec_seq_lens.index_select(0, seq_sel)
            decode_max_blocks = -(-max_len // block_size)
            decode_block_ids = tables[:, :decode_max_blocks].reshape(-1).to(torch.int64)
            key_pos = torch.arange(decode_max_blocks * block_size, device=device)
            allowed = key_pos[None, :] < dec_seq_lens.to(torch.int64)[:, None]
            decode_mask = _additive_mask(allowed, dtype)[:, None, None, :]
        return _StepPlan(metadata, dtype, block_size, write_slots, write_rows, decode_rows, decode_block_ids,
                         decode_mask, num_decode, decode_max_blocks, prefills)

    @staticmethod
    def _plan_prefill(metadata: AttentionMetadata, i: int, start: int, q_len: int, s_len: int,
                      block_size: int, dtype: torch.dtype) -> _PrefillSeq:
        if s_len == q_len:  # no cached prefix: causal attention over this step's K/V
            return _PrefillSeq(start, start + q_len, s_len, None, None)
        device = metadata.block_tables.device
        num_blocks = -(-s_len // block_size)
        block_ids = metadata.block_tables[i, :num_blocks].to(torch.int64)
        # query t sits at position s_len - q_len + t and sees keys 0..that position
        q_pos = torch.arange(s_len - q_len, s_len, device=device)
        k_pos = torch.arange(s_len, device=device)
        mask = _additive_mask(k_pos[None, :] <= q_pos[:, None], dtype)
        return _PrefillSeq(start, start + q_len, s_len, block_ids, mask)

    # ------------------------------------------------------------------ forward
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
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        plan = self._get_plan(metadata, block_size, query.dtype)

        # 1. Write this step's K/V first (see the module docstring for why the order matters).
        key_slots = key_cache.view(num_blocks * block_size, num_kv_heads, head_size)
        value_slots = value_cache.view(num_blocks * block_size, num_kv_heads, head_size)
        if plan.write_rows is None:
            key_slots.index_copy_(0, plan.write_slots, key)
            value_slots.index_copy_(0, plan.write_slots, value)
        else:
            key_slots.index_copy_(0, plan.write_slots, key.index_select(0, plan.write_rows))
            value_slots.index_copy_(0, plan.write_slots, value.index_select(0, plan.write_rows))

        # 2. Attend.
        if plan.num_decode and plan.decode_rows is None and not plan.prefills:
            return self._decode(query, key_cache, value_cache, plan, group, scale)
        output = torch.empty_like(query)
        if plan.num_decode:
            q = query.index_select(0, plan.decode_rows)
            output.index_copy_(0, plan.decode_rows, self._decode(q, key_cache, value_cache, plan, group, scale))
        for seq in plan.prefills:
            q = query[seq.query_start : seq.query_end].transpose(0, 1)  # [num_heads, q_len, head_size]
            if seq.block_ids is None:
                k = key[seq.query_start : seq.query_end].transpose(0, 1)
                v = value[seq.query_start : seq.query_end].transpose(0, 1)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                ctx = seq.block_ids.shape[0] * block_size
                k = key_cache.index_select(0, seq.block_ids).view(ctx, num_kv_heads, head_size)
                v = value_cache.index_select(0, seq.block_ids).view(ctx, num_kv_heads, head_size)
                k = k[: seq.seq_len].transpose(0, 1)  # [num_kv_heads, seq_len, head_size]
                v = v[: seq.seq_len].transpose(0, 1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=seq.mask, scale=scale, enable_gqa=group > 1)
            output[seq.query_start : seq.query_end] = out.transpose(0, 1)
        return output

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [num_decode, num_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        plan: _StepPlan,
        group: int,
        scale: float,
    ) -> torch.Tensor:  # [num_decode, num_heads, head_size]
        _, block_size, num_kv_heads, head_size = key_cache.shape
        n = plan.num_decode
        ctx = plan.decode_max_blocks * block_size
        k = key_cache.index_select(0, plan.decode_block_ids).view(n, ctx, num_kv_heads, head_size)
        v = value_cache.index_select(0, plan.decode_block_ids).view(n, ctx, num_kv_heads, head_size)
        q = query.view(n, num_kv_heads, group, head_size)  # the group acts as query rows
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.decode_mask, scale=scale
        )  # [n, num_kv_heads, group, head_size]
        return out.reshape(n, num_kv_heads * group, head_size)
