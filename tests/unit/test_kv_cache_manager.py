"""KVCacheManager: prefix hits, allocation, caching of full blocks, freeing (exact ids and counts)."""

import pytest

from backend.engine.request import Request
from backend.kv_cache import manager as mgr
from backend.kv_cache.block_pool import BlockHash
from backend.kv_cache.manager import KVCacheManager
from backend.protocol.sampling import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id, token_ids):
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8))


def ids(blocks):
    return [block.block_id for block in blocks]


def admit(manager, request, num_new_tokens=None):
    """What the scheduler does for a waiting request: hit, allocate, advance."""
    blocks, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new_blocks = manager.allocate_slots(request, num_new_tokens, blocks)
    assert new_blocks is not None
    request.num_computed_tokens = num_hit + num_new_tokens
    return blocks, num_hit, new_blocks


def test_shared_prefix_between_two_requests():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, enable_caching=True)
    common = list(range(8))  # two full blocks
    req0 = make_request("0", common + [100, 101, 102])  # 11 tokens: 3 blocks, last partial
    hit, num_hit, new = admit(manager, req0)
    assert (hit, num_hit) == ([], 0) and ids(new) == [1, 2, 3]
    assert [manager.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]

    req1 = make_request("1", common + [200, 201, 202, 203, 204])  # 13 tokens
    hit, num_hit, new = admit(manager, req1)
    assert ids(hit) == [1, 2] and num_hit == 8 and ids(new) == [4, 5]
    assert manager.get_block_ids("1") == [1, 2, 4, 5]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 1, 1, 1]
    assert manager.prefix_queries == 11 + 13 and manager.prefix_hits == 8
    assert manager.num_free_blocks == 5 and manager.usage == pytest.approx(5 / 10)

    manager.free(req0)
    # Tail first: block 3 (req0 only) is freed; 2 and 1 are still held by req1.
    assert ids(manager.block_pool.free_block_queue) == [6, 7, 8, 9, 10, 3]
    manager.free(req1)
    assert ids(manager.block_pool.free_block_queue) == [6, 7, 8, 9, 10, 3, 5, 4, 2, 1]
    assert manager.get_block_ids("1") == [] and manager.usage == 0.0


def test_full_hit_capped_at_num_tokens_minus_one():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    tokens = list(range(12))  # exactly three full blocks
    req0 = make_request("0", tokens)
    admit(manager, req0)
    manager.free(req0)
    req1 = make_request("1", tokens)
    hit, num_hit, new = admit(manager, req1)
    assert ids(hit) == [1, 2] and num_hit == 8  # the last block is recomputed, not hit
    assert len(new) == 1 and manager.get_block_ids("1") == [1, 2, new[0].block_id]
    # One token longer: all three blocks hit, one token left to compute.
    req2 = make_request("2", tokens + [99])
    hit, num_hit, _ = admit(manager, req2)
    assert ids(hit) == [1, 2, 3] and num_hit == 12


def test_partial_last_block_not_cached_until_full():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    req = make_request("0", [1, 2, 3, 4, 5, 6])
    admit(manager, req)
    b1, b2 = manager.req_to_blocks["0"]
    assert b1.block_hash is not None and b2.block_hash is None
    # Decode: append tokens one by one; block 2 is cached when its 4th token is scheduled.
    for token in (7, 8):
        req.append_output_token(token)
        assert manager.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    assert b2.block_hash is not None and b2.token_ids == (5, 6, 7, 8)
    assert b2.parent_hash == b1.block_hash
    req.append_output_token(9)
    new = manager.allocate_slots(req, 1)
    assert ids(new) == [3] and new[0].block_hash is None
    other = make_request("1", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    hit, num_hit = manager.get_computed_blocks(other)
    assert hit == [b1, b2] and num_hit == 8


def test_chunked_allocation_caches_only_scheduled_tokens():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    req = make_request("0", list(range(10)))
    admit(manager, req, num_new_tokens=5)  # chunk of 5: one full block, one partial
    assert manager.get_block_ids("0") == [1, 2]
    assert [b.block_hash is not None for b in manager.req_to_blocks["0"]] == [True, False]
    assert ids(manager.allocate_slots(req, 5)) == [3]
    assert [b.block_hash is not None for b in manager.req_to_blocks["0"]] == [True, True, False]


def test_eviction_lru_order_with_tail_first_freeing():
    manager = KVCacheManager(num_blocks=7, block_size=BLOCK_SIZE, enable_caching=True)
    req_a = make_request("a", list(range(0, 12)) + [-1])  # blocks 1,2,3 full + 4 partial
    admit(manager, req_a)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    manager.free(req_a)
    assert ids(manager.block_pool.free_block_queue) == [5, 6, 4, 3, 2, 1]
    # A request needing 3 new blocks takes 5, 6 (never used) and then 4 (uncached tail).
    req_b = make_request("b", list(range(100, 112)))
    _, num_hit, new = admit(manager, req_b)
    assert num_hit == 0 and ids(new) == [5, 6, 4]
    # Next evictions hit the cached chain tail first: block 3, so blocks 1, 2 still hit.
    req_c = make_request("c", [200, 201, 202, 203, 204])
    _, _, new = admit(manager, req_c)
    assert ids(new) == [3, 2]
    req_d = make_request("d", list(range(0, 12)) + [-1])
    hit, num_hit = manager.get_computed_blocks(req_d)
    assert ids(hit) == [1] and num_hit == 4


def test_allocate_returns_none_without_side_effects():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, enable_caching=True)
    req0 = make_request("0", list(range(9)))  # 3 blocks
    admit(manager, req0)
    manager.free(req0)
    assert ids(manager.block_pool.free_block_queue) == [4, 3, 2, 1]
    # 16 tokens = 4 blocks: hits 1, 2 (free, cached) and 2 new from the 4 - 2 left: fits.
    req1 = make_request("1", list(range(8)) + [50] * 8)
    hit, num_hit = manager.get_computed_blocks(req1)
    assert ids(hit) == [1, 2]
    # One token more than fits: 5 blocks needed, the pool has 4 usable.
    big = make_request("2", list(range(8)) + [50] * 9)
    hit_big, _ = manager.get_computed_blocks(big)
    before = [(b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks]
    queue_before = ids(manager.block_pool.free_block_queue)
    assert manager.allocate_slots(big, big.num_tokens - 8, hit_big) is None
    assert [(b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks] == before
    assert ids(manager.block_pool.free_block_queue) == queue_before
    assert manager.get_block_ids("2") == []
    new = manager.allocate_slots(req1, req1.num_tokens - num_hit, hit)
    assert ids(new) == [4, 3] and manager.get_block_ids("1") == [1, 2, 4, 3]
    assert manager.num_free_blocks == 0


def test_caching_disabled():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=False)
    req0 = make_request("0", list(range(8)))
    admit(manager, req0)
    manager.free(req0)
    req1 = make_request("1", list(range(8)))
    hit, num_hit, new = admit(manager, req1)
    assert hit == [] and num_hit == 0 and len(new) == 2
    assert manager.prefix_queries == 0 and manager.prefix_hits == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)


def test_hash_collision_child_of_uncached_parent_is_not_cached(monkeypatch):
    # A block hash that ignores the parent and sums the tokens: [1, 2] and [3, 0] collide.
    monkeypatch.setattr(mgr, "hash_block_tokens", lambda parent, tokens: BlockHash(sum(tokens)))
    manager = KVCacheManager(num_blocks=12, block_size=2, enable_caching=True)
    x = make_request("x", [1, 2, 9])
    admit(manager, x)  # caches [1, 2] under hash 3
    y = make_request("y", [3, 0, 5, 5, 9])
    hit, num_hit, new = admit(manager, y)
    assert (hit, num_hit) == ([], 0) and ids(new) == [3, 4, 5]  # [3, 0] is verified: a miss
    # y's [3, 0] cannot take hash 3; its child [5, 5] (KV computed after [3, 0]) must not be
    # cached either: its parent hash 3 would name x's [1, 2] block.
    assert [manager.block_pool.blocks[i].block_hash for i in (3, 4)] == [None, None]
    w = make_request("w", [1, 2, 5, 5, 9])
    hit, num_hit = manager.get_computed_blocks(w)
    assert ids(hit) == [1] and num_hit == 2  # x's block only, never y's [5, 5]


def test_hash_collision_after_eviction(monkeypatch):
    monkeypatch.setattr(mgr, "hash_block_tokens", lambda parent, tokens: BlockHash(sum(tokens)))
    manager = KVCacheManager(num_blocks=7, block_size=2, enable_caching=True)
    x = make_request("x", [1, 2, 5, 5, 9])
    admit(manager, x)  # blocks 1, 2 cached (hashes 3, 10), 3 partial
    y = make_request("y", [3, 0, 5, 5, 9])
    admit(manager, y)  # blocks 4, 5, 6, none cached
    manager.free(x)
    manager.free(y)
    assert ids(manager.block_pool.free_block_queue) == [3, 2, 1, 6, 5, 4]
    z = make_request("z", [3, 0, 5, 5, 9])
    _, num_hit, new = admit(manager, z)  # reuses 3, 2, 1: x's chain is evicted, z owns the hashes
    assert num_hit == 0 and ids(new) == [3, 2, 1]
    w = make_request("w", [1, 2, 5, 5, 9])  # x's content again: must not hit z's blocks
    assert manager.get_computed_blocks(w) == ([], 0)
    v = make_request("v", [3, 0, 5, 5, 9])
    hit, num_hit = manager.get_computed_blocks(v)
    assert ids(hit) == [3, 2] and num_hit == 4


def test_free_unknown_request_is_noop_and_block_ids_empty():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE, enable_caching=True)
    manager.free(make_request("nobody", [1]))
    assert manager.get_block_ids("nobody") == [] and manager.num_free_blocks == 2


def test_hit_must_start_empty_block_table():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True)
    req0 = make_request("0", list(range(9)))
    admit(manager, req0)
    hit, _ = manager.get_computed_blocks(make_request("x", list(range(9))))
    with pytest.raises(ValueError):
        manager.allocate_slots(req0, 1, hit)
