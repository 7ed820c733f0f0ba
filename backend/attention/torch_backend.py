"""Paged attention in plain torch: the reference backend on CPU and a fallback on CUDA.

One call per layer does two things, in this order (an invariant, not a detail):
  1. write every new K/V of the step into its slot (``slot_mapping``; -1 means skip);
  2. attend each sequence's new queries over its whole context, read back from the paged cache.
Writing first matters because a sequence may read blocks that another sequence of the same step
is filling (a prefix-cache hit on blocks computed in this very step).

How it is fast on CPU (measured with variants; see the report of the commit that added it):
  * sequences with one new token (decode) are batched into a few SDPA calls: their blocks are
    gathered into a padded ``[n, max_blocks * block_size, num_kv_heads, head_size]`` tensor, a
    float mask hides the padding, and GQA is handled by viewing the queries as
    ``[n, num_kv_heads, group, head_size]`` (the group plays the role of query rows, so K/V are
    never repeated). One call pads every sequence to the longest; when context lengths differ a
    lot (a 40-token chat next to a 700-token one), the sequences sorted by length are split into
    up to ``MAX_DECODE_GROUPS`` groups where that saves more padded work than an extra call costs
    (``plan_decode_groups``);
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


MAX_DECODE_GROUPS = 4
# Fixed cost of one more decode SDPA call (gather, mask, launch), in units of "one sequence attending
# over one key position": about what 16 sequences x 128 positions of padding cost (measured on CPU).
DECODE_GROUP_COST = 2048


@dataclass(slots=True)
class _DecodeGroup:
    """Decode sequences attended in one SDPA call, padded to the group's longest context."""

    rows: torch.Tensor | None  # [n] int64 indices into the step's decode queries; None: the only group, all of them
    block_ids: torch.Tensor  # [n * max_blocks] int64
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] additive float
    size: int
    max_blocks: int


def plan_decode_groups(seq_lens: list[int], block_size: int, max_groups: int | None = None,
                       group_cost: int | None = None) -> list[list[int]]:
    """Splits decode sequences (by index) into groups that minimise padded attention work.

    Work of a group = its size x its longest context (in whole blocks), plus ``group_cost`` per
    group; groups are contiguous runs of the sequences sorted by length, longest first, found by
    dynamic programming (n <= max_num_seqs, so O(max_groups * n^2) is nothing next to a step).
    """
    max_groups = MAX_DECODE_GROUPS if max_groups is None else max_groups
    group_cost = DECODE_GROUP_COST if group_cost is None else group_cost
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    padded = [-(-seq_lens[i] // block_size) * block_size for i in order]
    n = len(order)
    if n == 0:
        return []
    inf = float("inf")
    # best[k][j]: least work covering the first j sorted sequences with k groups
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for k in range(1, max_groups + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):  # group = sorted[i:j], its longest is padded[i]
                work = best[k - 1][i] + (j - i) * padded[i] + group_cost
                if work < best[k][j]:
                    best[k][j], cut[k][j] = work, i
    groups_used = min(range(1, max_groups + 1), key=lambda k: best[k][n])
    groups, j = [], n
    for k in range(groups_used, 0, -1):
        i = cut[k][j]
        groups.append(sorted(order[i:j]))  # index order inside a group: one group of all needs no permutation
        j = i
    return groups[::-1]


@dataclass(slots=True)
class _StepPlan:
    """Per-step indices and masks, shared by all layers."""

    metadata: AttentionMetadata  # the step this plan belongs to (compared by identity)
    dtype: torch.dtype
    block_size: int
    write_slots: torch.Tensor  # [num_valid] int64 slots to write
    write_rows: torch.Tensor | None  # [num_valid] int64 rows of key/value; None: all rows, in order
    decode_rows: torch.Tensor | None  # [num_decode] int64 query rows; None: every row is a decode
    decode_groups: list[_DecodeGroup]
    num_decode: int
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
        decode_rows = None
        if num_decode and num_decode != len(query_lens):  # mixed step: the decode rows among the queries
            decode_rows = torch.tensor(decode_row_list, dtype=torch.int64, device=device)
        decode_groups = []
        decode_lens = [seq_lens[i] for i in decode_idx]
        for members in plan_decode_groups(decode_lens, block_size):  # members are in index order
            in_order = len(members) == num_decode  # the only group: every decode, in order
            if in_order and num_decode == len(query_lens):
                tables, group_lens, rows = metadata.block_tables, metadata.seq_lens, None
            else:
                seqs = torch.tensor([decode_idx[m] for m in members], dtype=torch.int64, device=device)
                tables = metadata.block_tables.index_select(0, seqs)
                group_lens = metadata.seq_lens.index_select(0, seqs)
                rows = None if in_order else torch.tensor(members, dtype=torch.int64, device=device)
            max_blocks = -(-max(decode_lens[m] for m in members) // block_size)
            key_pos = torch.arange(max_blocks * block_size, device=device)
            allowed = key_pos[None, :] < group_lens.to(torch.int64)[:, None]
            decode_groups.append(_DecodeGroup(rows, tables[:, :max_blocks].reshape(-1).to(torch.int64),
                                              _additive_mask(allowed, dtype)[:, None, None, :], len(members),
                                              max_blocks))
        return _StepPlan(metadata, dtype, block_size, write_slots, write_rows, decode_rows, decode_groups,
                         num_decode, prefills)

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
        if len(plan.decode_groups) == 1:  # one group holds every decode, in order (rows is None)
            return TorchAttentionBackend._decode_group(query, key_cache, value_cache, plan.decode_groups[0], group,
                                                       scale)
        output = torch.empty_like(query)
        for decode_group in plan.decode_groups:
            q = query.index_select(0, decode_group.rows)
            out = TorchAttentionBackend._decode_group(q, key_cache, value_cache, decode_group, group, scale)
            output.index_copy_(0, decode_group.rows, out)
        return output

    @staticmethod
    def _decode_group(
        query: torch.Tensor,  # [n, num_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        decode_group: _DecodeGroup,
        group: int,
        scale: float,
    ) -> torch.Tensor:  # [n, num_heads, head_size]
        _, block_size, num_kv_heads, head_size = key_cache.shape
        n, ctx = decode_group.size, decode_group.max_blocks * block_size
        k = key_cache.index_select(0, decode_group.block_ids).view(n, ctx, num_kv_heads, head_size)
        v = value_cache.index_select(0, decode_group.block_ids).view(n, ctx, num_kv_heads, head_size)
        q = query.view(n, num_kv_heads, group, head_size)  # the group acts as query rows
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=decode_group.mask, scale=scale
        )  # [n, num_kv_heads, group, head_size]
        return out.reshape(n, num_kv_heads * group, head_size)
