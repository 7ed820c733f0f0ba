"""TorchAttentionBackend against a naive per-position reference over shuffled paged block tables."""

from __future__ import annotations

import math

import pytest
import torch

from backend.attention.base import AttentionMetadata
from backend.attention.selector import get_attention_backend
from backend.attention.torch_backend import TorchAttentionBackend

HEAD_SIZE = 16
NUM_KV_HEADS = 2


def _naive_attention(
    q: torch.Tensor,  # [num_new, num_heads, head_size]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    scale: float,
) -> torch.Tensor:  # [num_new, num_heads, head_size]
    """Float64 loops: query t (position seq_len - num_new + t) sees keys 0..its position."""
    num_new, num_heads, _ = q.shape
    seq_len = k.shape[0]
    group = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(num_new):
        last = seq_len - num_new + t
        for h in range(num_heads):
            kv = h // group
            scores = (k[: last + 1, kv].double() @ q[t, h].double()) * scale
            out[t, h] = torch.softmax(scores, 0) @ v[: last + 1, kv].double()
    return out


def _run_step(seqs, ratio, block_size, seed=0, shared_prefix=None, device="cpu"):
    """Builds a paged cache holding each sequence's prefix, runs one backend step, checks it.

    seqs: list of (num_computed, num_new), in any order: the batch lists the decodes first, as the
    model runner does. shared_prefix: (writer, reader) indices into ``seqs``: the reader's first
    blocks are the writer's blocks, filled by the writer in this same step.
    """
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] != 1)  # stable: decodes first
    seqs = [seqs[i] for i in order]
    if shared_prefix is not None:
        shared_prefix = tuple(order.index(i) for i in shared_prefix)
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * ratio
    blocks_per_seq = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # shuffled, never the null block 0
    tables, pos = [], 0
    for nb in blocks_per_seq:
        tables.append(ids[pos : pos + nb])
        pos += nb
    # ground-truth K/V of every position of every sequence
    keys = [torch.randn(c + n, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for c, n in seqs]
    values = [torch.randn(c + n, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for c, n in seqs]
    if shared_prefix is not None:
        writer, reader = shared_prefix
        wc, wn = seqs[writer]
        rc, _ = seqs[reader]
        assert wc == 0 and rc % block_size == 0 and rc <= wn
        shared = rc // block_size
        tables[reader][:shared] = tables[writer][:shared]
        keys[reader][:rc] = keys[writer][:rc]
        values[reader][:rc] = values[writer][:rc]

    key_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE)
    value_cache = torch.zeros_like(key_cache)
    for i, (c, _) in enumerate(seqs):
        if shared_prefix is not None and i == shared_prefix[1]:
            continue  # its prefix is written by the writer during the step
        for p in range(c):
            key_cache[tables[i][p // block_size], p % block_size] = keys[i][p]
            value_cache[tables[i][p // block_size], p % block_size] = values[i][p]

    query = torch.cat([torch.randn(n, num_heads, HEAD_SIZE, generator=gen) for _, n in seqs])
    key = torch.cat([keys[i][c:] for i, (c, _) in enumerate(seqs)])
    value = torch.cat([values[i][c:] for i, (c, _) in enumerate(seqs)])
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, (c, n) in enumerate(seqs) for p in range(c, c + n)]
    width = max(blocks_per_seq) + 1  # wider than needed: padding must be harmless
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    seq_lens = [c + n for c, n in seqs]
    query_lens = [n for _, n in seqs]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    metadata = AttentionMetadata.build(torch.tensor(slots, dtype=torch.int64), block_tables, seq_lens, query_lens)
    assert metadata.query_start_loc.tolist() == qsl
    scale = HEAD_SIZE**-0.5
    backend = TorchAttentionBackend(device)
    if device != "cpu":
        query, key, value = query.to(device), key.to(device), value.to(device)
        key_cache, value_cache = key_cache.to(device), value_cache.to(device)
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            setattr(metadata, name, getattr(metadata, name).to(device))
    out = backend.forward(query, key, value, key_cache, value_cache, metadata, scale)
    assert out.shape == query.shape
    out2 = backend.forward(query, key, value, key_cache, value_cache, metadata, scale)
    assert torch.equal(out, out2)  # a second layer reusing the step's plan gives the same result
    out, key_cache, value_cache = out.cpu(), key_cache.cpu(), value_cache.cpu()

    for i, (c, n) in enumerate(seqs):
        ref = _naive_attention(query[qsl[i] : qsl[i + 1]], keys[i], values[i], scale)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), ref, atol=1e-5, rtol=1e-5)
        for p in range(c + n):  # the cache now holds every position's K/V
            block, offset = tables[i][p // block_size], p % block_size
            assert torch.equal(key_cache[block, offset], keys[i][p])
            assert torch.equal(value_cache[block, offset], values[i][p])
    assert not key_cache[0].any() and not value_cache[0].any(), "the null block was written"


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_only_step(ratio, block_size):
    # contexts: exact multiples of the block size, partial last blocks, a 1-token sequence
    seqs = [(block_size - 1, 1), (2 * block_size - 1, 1), (block_size, 1), (0, 1), (3 * block_size + 2, 1)]
    _run_step(seqs, ratio, block_size)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 7])
def test_mixed_step(ratio, block_size):
    seqs = [
        (2 * block_size - 1, 1),  # decode, block-aligned after the step
        (0, 3 * block_size),  # whole prompt, exact multiple
        (0, block_size + 3),  # whole prompt, partial last block
        (5, 1),  # decode
        (2 * block_size, block_size + 1),  # chunk after a block-aligned prefix
        (block_size + 2, 5),  # chunk after a prefix ending mid-block
    ]
    _run_step(seqs, ratio, block_size, seed=ratio)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ratio", [1, 4])
def test_mixed_step_on_cuda(ratio):
    block_size = 16
    seqs = [(31, 1), (0, 48), (0, 19), (5, 1), (32, 17), (18, 5)]
    _run_step(seqs, ratio, block_size, seed=ratio, device="cuda")


def test_prefill_only_step():
    _run_step([(0, 9), (3, 6), (8, 8)], ratio=2, block_size=4)


def test_prefix_blocks_written_in_the_same_step_are_visible():
    """Sequence 1 hits the prefix cache on blocks sequence 0 fills in this very step."""
    block_size = 4
    _run_step([(0, 10), (8, 3), (3, 1)], ratio=2, block_size=block_size, shared_prefix=(0, 1))


def test_slot_minus_one_is_not_written():
    backend = TorchAttentionBackend("cpu")
    key_cache = torch.zeros(3, 4, NUM_KV_HEADS, HEAD_SIZE)
    value_cache = torch.zeros_like(key_cache)
    metadata = AttentionMetadata.build(torch.tensor([4, -1], dtype=torch.int64),
                                       torch.tensor([[1], [2]], dtype=torch.int32), [1, 1], [1, 1])
    q = torch.randn(2, 2 * NUM_KV_HEADS, HEAD_SIZE)
    k = torch.randn(2, NUM_KV_HEADS, HEAD_SIZE)
    backend.forward(q, k, k.clone(), key_cache, value_cache, metadata, 0.25)
    assert torch.equal(key_cache[1, 0], k[0])
    assert not key_cache[2].any() and not key_cache[0].any()


def test_metadata_refuses_a_decode_after_a_prefill():
    with pytest.raises(ValueError, match="one new token must come first"):
        AttentionMetadata.build(torch.zeros(4, dtype=torch.int64), torch.ones(2, 1, dtype=torch.int32), [3, 5], [3, 1])


def test_selector():
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    with pytest.raises(ValueError, match="cupy"):
        get_attention_backend("cupy", "cpu")
    with pytest.raises(ValueError, match="unknown 'flash'"):
        get_attention_backend("flash", "cpu")


def test_plan_decode_groups_splits_very_different_lengths_only():
    from backend.attention.torch_backend import plan_decode_groups

    lens = [700, 20, 690, 30, 25, 710]
    groups = plan_decode_groups(lens, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))  # each sequence exactly once
    assert sorted(map(sorted, groups)) == [[0, 2, 5], [1, 3, 4]]
    assert all(g == sorted(g) for g in groups)
    assert plan_decode_groups([100, 90, 110, 95], 16) == [[0, 1, 2, 3]]  # similar lengths: one call
    assert len(plan_decode_groups(lens, 16, group_cost=10**9)) == 1
    assert len(plan_decode_groups(list(range(1, 400, 7)), 16, max_groups=3, group_cost=0)) == 3
    assert plan_decode_groups([], 16) == []


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_groups_give_the_same_attention(monkeypatch, ratio, block_size):
    import backend.attention.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "DECODE_GROUP_COST", 0)  # split as much as allowed
    decodes = [(12 * block_size + 3, 1), (2, 1), (9 * block_size, 1), (block_size - 1, 1), (0, 1), (5 * block_size, 1)]
    _run_step(decodes, ratio, block_size, seed=3)
    mixed = [decodes[0], (0, 2 * block_size + 1), decodes[1], (block_size + 2, 5), decodes[2], decodes[3]]
    _run_step(mixed, ratio, block_size, seed=4)
