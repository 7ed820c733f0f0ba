"""Paged attention in plain torch: the reference backend on CPU and a fallback on CUDA.

The write-then-attend order, the decodes-first batch and the prefill path are the shared part
(backend/attention/paged.py). What is torch's own:
  * the cache write: one ``index_copy_`` of the step's K/V into their slots (slot -1 skipped);
  * decodes, batched into a few SDPA calls: their blocks are gathered into a padded
    ``[n, max_blocks * block_size, num_kv_heads, head_size]`` tensor, a float mask hides the
    padding, and GQA is handled by viewing the queries as ``[n, num_kv_heads, group, head_size]``
    (the group plays the role of query rows, so K/V are never repeated). One call pads every
    sequence to the longest; when context lengths differ a lot (a 40-token chat next to a
    700-token one), the sequences sorted by length are split into up to ``MAX_DECODE_GROUPS``
    groups where that saves more padded work than an extra call costs (``plan_decode_groups``).
    With a sliding window W each decode gathers only the blocks from the one holding its position
    seq_len - W on, and the mask also hides that block's positions before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.attention.base import AttentionMetadata
from backend.attention.paged import PagedAttentionBackend, additive_mask
from backend.models.shape import ceil_div

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
    padded = [ceil_div(seq_lens[i], block_size) * block_size for i in order]
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


def plan_cache_write(
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1: do not write
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([num_valid] slots, [num_valid] rows or None: all rows)
    """The slots to write this step's K/V into, and which rows of key/value go there."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping, None
    write_rows = valid.nonzero().squeeze(1)
    return slot_mapping.index_select(0, write_rows), write_rows


@dataclass(slots=True)
class _TorchPlan:
    """The torch backend's per-step part of the plan: where to write, and the decode groups."""

    write_slots: torch.Tensor  # [num_valid] int64 slots to write
    write_rows: torch.Tensor | None  # [num_valid] int64 rows of key/value; None: all rows, in order
    decode_groups: list[_DecodeGroup]


class TorchAttentionBackend(PagedAttentionBackend):
    """AttentionBackend in torch ops (SDPA), for any device torch supports."""

    name = "torch"

    def __init__(self, device: torch.device | str | None = None):
        super().__init__()
        self.device = torch.device(device) if device is not None else None

    def plan_step(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype,
                  window: int = 0) -> _TorchPlan:
        device = metadata.slot_mapping.device
        write_slots, write_rows = plan_cache_write(metadata.slot_mapping)
        num_decodes = metadata.num_decodes
        decode_lens = metadata.seq_lens_list[:num_decodes]
        if window:  # the positions read: from the start of the block holding the window's first one
            decode_lens = [n - max(0, n - window) // block_size * block_size for n in decode_lens]
        decode_groups = []
        for members in plan_decode_groups(decode_lens, block_size):  # members are in index order
            if len(members) == num_decodes:  # the only group: every decode, in order
                tables, group_lens, rows = metadata.block_tables[:num_decodes], metadata.seq_lens[:num_decodes], None
            else:
                rows = torch.tensor(members, dtype=torch.int64, device=device)
                tables = metadata.block_tables.index_select(0, rows)
                group_lens = metadata.seq_lens.index_select(0, rows)
            max_blocks = ceil_div(max(decode_lens[m] for m in members), block_size)
            group_lens = group_lens.to(torch.int64)
            if not window:
                key_pos = torch.arange(max_blocks * block_size, device=device)
                allowed = key_pos[None, :] < group_lens[:, None]
                block_ids = tables[:, :max_blocks].reshape(-1).to(torch.int64)
            else:
                first_block = (group_lens - window).clamp_(min=0) // block_size  # [n]
                index = first_block[:, None] + torch.arange(max_blocks, device=device)  # [n, max_blocks]
                # past a row's last block: a block of its table (or the null block), masked below
                block_ids = tables.gather(1, index.clamp(max=tables.shape[1] - 1)).reshape(-1).to(torch.int64)
                key_pos = (index[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
                allowed = (key_pos < group_lens[:, None]) & (key_pos >= group_lens[:, None] - window)
            decode_groups.append(_DecodeGroup(rows, block_ids, additive_mask(allowed, dtype)[:, None, None, :],
                                              len(members), max_blocks))
        return _TorchPlan(write_slots, write_rows, decode_groups)

    def write_cache(self, key, value, key_cache, value_cache, metadata, plan: _TorchPlan) -> None:
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        key_slots = key_cache.view(num_blocks * block_size, num_kv_heads, head_size)
        value_slots = value_cache.view(num_blocks * block_size, num_kv_heads, head_size)
        if plan.write_rows is None:
            key_slots.index_copy_(0, plan.write_slots, key)
            value_slots.index_copy_(0, plan.write_slots, value)
        else:
            key_slots.index_copy_(0, plan.write_slots, key.index_select(0, plan.write_rows))
            value_slots.index_copy_(0, plan.write_slots, value.index_select(0, plan.write_rows))

    def decode(self, query, key_cache, value_cache, metadata, plan: _TorchPlan, scale: float) -> torch.Tensor:
        group = query.shape[1] // key_cache.shape[2]
        if len(plan.decode_groups) == 1:  # one group holds every decode, in order (rows is None)
            return _decode_group(query, key_cache, value_cache, plan.decode_groups[0], group, scale)
        output = torch.empty_like(query)
        for decode_group in plan.decode_groups:
            q = query.index_select(0, decode_group.rows)
            output.index_copy_(0, decode_group.rows, _decode_group(q, key_cache, value_cache, decode_group, group,
                                                                   scale))
        return output


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
