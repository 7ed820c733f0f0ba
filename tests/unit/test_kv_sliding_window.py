"""KVCacheManager with a sliding window on every layer: blocks the window has passed are given back.

Window 6, blocks of 4: a query at position p reads p - 5 .. p, so before computing from p the
blocks wholly before p - 5 go back to the pool (null entries in the table), exact ids and counts.
"""

import pytest

from backend.engine.request import Request
from backend.kv_cache.block_pool import NULL_BLOCK_ID
from backend.kv_cache.manager import KVCacheManager
from backend.protocol.sampling import SamplingParams

BLOCK_SIZE = 4
WINDOW = 6


def make_request(request_id, token_ids):
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=64))


def manager_with(num_blocks=12, caching=True, window=WINDOW):
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_caching=caching, sliding_window=window)


def run(manager, request, num_new_tokens, hit=()):
    assert manager.allocate_slots(request, num_new_tokens, hit) is not None
    request.num_computed_tokens += len(hit) * BLOCK_SIZE + num_new_tokens


def decode(manager, request, token):
    request.append_output_token(token)
    run(manager, request, 1)


def test_blocks_behind_the_window_go_back_as_the_request_grows():
    manager = manager_with()
    request = make_request("a", range(10))
    run(manager, request, 6)  # positions 0..5: nothing passed yet
    assert manager.get_block_ids("a") == [1, 2]
    run(manager, request, 4)  # from position 6 the window starts at 1: block 0 still read
    assert manager.get_block_ids("a") == [1, 2, 3] and manager.num_window_freed == 0
    decode(manager, request, 50)  # from position 10 the window starts at 5: block 0 (positions 0..3) passed
    assert manager.get_block_ids("a") == [NULL_BLOCK_ID, 2, 3]
    assert manager.num_window_freed == 1 and manager.block_pool.blocks[1].ref_cnt == 0
    for token in range(51, 58):
        decode(manager, request, token)  # positions 11..17
    table = manager.get_block_ids("a")
    assert table[:3] == [NULL_BLOCK_ID] * 3 and len(table) == 5  # 18 tokens; the window 12..17 in blocks 3, 4
    assert sum(b != NULL_BLOCK_ID for b in table) == 2 and manager.num_window_freed == 3
    manager.free(request)  # null entries are not freed again
    assert manager.usage == 0.0 and manager.num_free_blocks == 11


def test_given_back_blocks_stay_cached_and_a_later_hit_takes_only_its_window():
    manager = manager_with()
    tokens = list(range(17))  # four full blocks and one token
    first = make_request("a", tokens)
    run(manager, first, 8)
    run(manager, first, 4)  # from position 8 the window starts at 3: block 0 still read
    run(manager, first, 4)  # from position 12 it starts at 7: block 0 passed, still cached
    assert manager.get_block_ids("a")[0] == NULL_BLOCK_ID
    assert manager.block_pool.blocks[1].block_hash is not None and manager.block_pool.blocks[1].ref_cnt == 0
    manager.free(first)
    second = make_request("b", tokens)
    hit, num_hit = manager.get_computed_blocks(second)  # the whole chain is still cached
    assert [b.block_id for b in hit] == [1, 2, 3, 4] and num_hit == 16
    run(manager, second, 1, hit)  # from position 16 the window starts at 11: blocks 0 and 1 passed
    assert manager.get_block_ids("b")[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert manager.num_free_blocks == 12 - 1 - 3  # blocks 3, 4 and the new one are held


def test_a_block_filled_after_its_parent_passed_is_cached_while_the_parent_is():
    """A window shorter than a block: block 1 fills (position 7) when block 0 has already passed;
    block 0 is still in the prefix cache, so block 1 joins the chain."""
    manager = manager_with(window=3)
    request = make_request("a", range(4))
    run(manager, request, 4)
    for token in (50, 51, 52, 53):  # positions 4..7
        decode(manager, request, token)
    first, second = manager.get_block_ids("a")[:2]
    assert first == NULL_BLOCK_ID and manager.block_pool.blocks[1].block_hash is not None
    assert manager.block_pool.blocks[second].block_hash is not None
    assert manager.block_pool.blocks[second].parent_hash == manager.block_pool.blocks[1].block_hash


def test_a_fork_shares_the_live_blocks_and_the_null_entries():
    manager = manager_with()
    parent = make_request("p", range(14))
    run(manager, parent, 14)
    decode(manager, parent, 99)  # from position 14: block 0 and 1 (0..7) passed
    assert manager.get_block_ids("p")[:2] == [NULL_BLOCK_ID] * 2
    child = make_request("c", parent.all_token_ids)
    manager.fork(parent, child)
    assert manager.get_block_ids("c") == manager.get_block_ids("p")
    assert [manager.block_pool.blocks[i].ref_cnt for i in manager.get_block_ids("p")[2:]] == [2, 2]
    manager.free(parent)
    manager.free(child)
    assert manager.usage == 0.0


def test_a_prefill_engine_keeps_every_block_for_its_pulls():
    manager = manager_with()
    manager.transfer_server = object()  # set: a pull reads the whole prompt
    request = make_request("a", range(16))
    run(manager, request, 8)
    run(manager, request, 8)
    assert NULL_BLOCK_ID not in manager.get_block_ids("a") and manager.num_window_freed == 0


@pytest.mark.parametrize(("window", "num_tokens", "max_chunk", "held"), [
    (0, 100, 8, 25),  # no window: every block
    (6, 100, 8, 5),  # (6 + 8 - 2) // 4 + 2
    (6, 100, 200, 25),  # one chunk of all 100 tokens: capped at every block
    (6, 5, 8, 2),
])
def test_the_most_blocks_a_request_holds(window, num_tokens, max_chunk, held):
    assert manager_with(window=window).max_blocks_held(num_tokens, max_chunk) == held


def test_the_bound_holds_for_every_chunking():
    """Every chunk size and every start: the live blocks never exceed max_blocks_held."""
    for chunk in (1, 2, 3, 4, 5, 7, 8):
        manager = manager_with(num_blocks=64, caching=False)
        request = make_request("a", range(60))
        while request.num_computed_tokens < 60:
            run(manager, request, min(chunk, 60 - request.num_computed_tokens))
            live = sum(b != NULL_BLOCK_ID for b in manager.get_block_ids("a"))
            assert live <= manager.max_blocks_held(60, chunk), (chunk, request.num_computed_tokens)
