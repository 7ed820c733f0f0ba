"""BlockPool and FreeBlockQueue: exact block ids, ref counts, LRU eviction order, cache table."""

import pytest

from backend.kv_cache import block_pool as bp
from backend.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks):
    return [block.block_id for block in blocks]


def test_free_queue_popleft_remove_append_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert ids(queue) == [1, 3, 4, 2, 0] and len(queue) == 5
    assert blocks[2] in queue
    with pytest.raises(ValueError):
        queue.append(blocks[2])
    for _ in range(5):
        queue.popleft()
    assert len(queue) == 0 and blocks[2] not in queue
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[1])


def test_null_block_never_handed_out():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    assert ids(pool.free_block_queue) == [1, 2, 3]
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3] and [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.null_block.ref_cnt == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.touch([pool.null_block])
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, enable_caching=False)


def test_free_order_is_eviction_order():
    pool = BlockPool(num_blocks=6, enable_caching=False)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    b = pool.get_new_blocks(2)  # 4, 5
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue) == [3, 2, 1]
    pool.free_blocks(reversed(b))
    assert ids(pool.free_block_queue) == [3, 2, 1, 5, 4]
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(2 / 5)


def test_double_free_rejected_without_side_effects():
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks([blocks[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[1], blocks[0]])
    assert blocks[1].ref_cnt == 1  # unchanged: the whole call was rejected
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[1], blocks[1]])
    assert blocks[1].ref_cnt == 1
    pool.free_blocks([blocks[1]])
    assert pool.num_free_blocks == 3


def test_touch_takes_cached_free_block_back():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(block, None, [1, 2])
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block in pool.free_block_queue and block.block_hash is not None
    hit = pool.get_cached_block(None, [1, 2])
    assert hit is block
    pool.touch([hit])
    pool.touch([hit])
    assert block.ref_cnt == 2 and block not in pool.free_block_queue
    assert ids(pool.free_block_queue) == [2, 3, 4]
    pool.free_blocks([block, block])
    assert ids(pool.free_block_queue) == [2, 3, 4, 1]


def test_lazy_eviction_keeps_hash_until_reuse():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, None, [1, 2])
    h1 = b1.block_hash
    pool.cache_full_block(b2, h1, [3, 4])
    pool.free_blocks([b2, b1])  # tail first
    assert pool.get_cached_block(None, [1, 2]) is b1
    assert pool.get_cached_block(h1, [3, 4]) is b2
    (reused,) = pool.get_new_blocks(1)  # LRU head: the tail block b2 goes first
    assert reused is b2 and b2.block_hash is None and b2.token_ids is None
    assert pool.get_cached_block(h1, [3, 4]) is None
    assert pool.get_cached_block(None, [1, 2]) is b1


def test_cache_full_block_first_registration_wins():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_full_block(b1, None, [7, 7])
    assert not pool.cache_full_block(b2, None, [7, 7])  # duplicate content: stays uncached
    assert b2.block_hash is None and pool.get_cached_block(None, [7, 7]) is b1
    with pytest.raises(ValueError):
        pool.cache_full_block(b1, None, [7, 7])


def test_reused_block_drops_stale_hash_only_when_table_points_to_it():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, None, [5, 6])
    h = b1.block_hash
    # Simulate a stale hash: the table entry for h now belongs to b2 (same tokens).
    b2.block_hash, b2.parent_hash, b2.token_ids = h, None, (5, 6)
    pool.cached_block_hash_to_block[h] = b2
    pool.free_blocks([b1])
    assert ids(pool.free_block_queue) == [3, 1]
    pool.get_new_blocks(2)  # reuses 3, then b1 whose hash is stale
    assert b1.block_hash is None
    assert pool.cached_block_hash_to_block[h] is b2  # the live entry survived
    assert pool.get_cached_block(None, [5, 6]) is b2
    # And the non-stale case does drop the entry.
    pool.free_blocks([b2])
    pool.get_new_blocks(1)
    assert h not in pool.cached_block_hash_to_block


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(bp, "hash_block_tokens", lambda parent, tokens: bp.BlockHash(42))
    pool = BlockPool(num_blocks=4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_full_block(b1, None, [1, 2])
    assert pool.get_cached_block(None, [3, 4]) is None  # same hash, other tokens
    assert pool.get_cached_block(bp.BlockHash(42), [1, 2]) is None  # same hash, other parent
    assert pool.get_cached_block(None, [1, 2]) is b1
    assert not pool.cache_full_block(b2, None, [3, 4])  # cannot steal the entry


def test_hash_is_chained():
    h1 = hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])


def test_caching_disabled_never_hits():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(block, None, [1])
    assert pool.get_cached_block(None, [1]) is None


def test_reset_prefix_cache():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, None, [1])
    pool.cache_full_block(b2, b1.block_hash, [2])
    pool.free_blocks([b2])
    pool.reset_prefix_cache()
    assert b1.block_hash is None and b2.block_hash is None
    assert pool.get_cached_block(None, [1]) is None
    assert b1.ref_cnt == 1 and pool.num_free_blocks == 2
