"""Forking a sequence's blocks and copy-on-write of the shared partial block (issue 16).

Scripted: exact block ids and reference counts through fork, copy-on-write, append and free,
a fork at a block boundary (no copy), a copy that does not fit (nothing changes), and the copy
itself on a real paged cache. Hypothesis: random forks, appends and frees against a model of the
cache's contents; every sequence always reads back exactly its own tokens (nobody sees another's
writes), reference counts equal the number of holders, and nothing is freed twice.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.engine.request import Request
from backend.kv_cache.manager import KVCacheManager
from backend.kv_cache.offload.block_io import PagedBlockIO
from backend.protocol.sampling import SamplingParams

BLOCK = 4


def new_request(request_id: str, num_tokens: int, start: int = 0) -> Request:
    return Request(request_id, list(range(start, start + num_tokens)), SamplingParams(max_tokens=64))


def computed(manager: KVCacheManager, request: Request, num_new: int) -> None:
    assert manager.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new


def refs(manager: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in manager.block_pool.blocks[1:] if b.ref_cnt}


def manager_with_copies(num_blocks: int = 10, caching: bool = False) -> tuple[KVCacheManager, list]:
    manager = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    copies: list = []
    manager.copy_blocks = lambda source, destination: copies.append((list(source), list(destination)))
    return manager, copies


def test_fork_shares_every_block_and_the_first_writer_copies_the_partial_one():
    manager, copies = manager_with_copies()
    parent = new_request("p", 10)
    computed(manager, parent, 10)  # blocks 1, 2, 3 (3 holds 2 of 4 slots)
    child = new_request("c", 10)
    manager.fork(parent, child)
    assert manager.get_block_ids("c") == [1, 2, 3] and child.num_computed_tokens == 10
    assert refs(manager) == {1: 2, 2: 2, 3: 2} and manager.block_pool.num_shared_references == 3
    child.append_output_token(99)
    computed(manager, child, 1)  # it writes slot 2 of block 3: a private copy first
    assert copies == [([3], [4])] and manager.get_block_ids("c") == [1, 2, 4]
    assert refs(manager) == {1: 2, 2: 2, 3: 1, 4: 1} and manager.num_copy_on_write == 1
    parent.append_output_token(98)
    computed(manager, parent, 1)  # block 3 is its own now: written in place
    assert copies == [([3], [4])] and manager.get_block_ids("p") == [1, 2, 3]
    manager.free(child)
    assert refs(manager) == {1: 1, 2: 1, 3: 1} and manager.block_pool.num_shared_references == 0
    manager.free(parent)
    assert refs(manager) == {} and manager.num_free_blocks == 9


def test_a_fork_at_a_block_boundary_copies_nothing():
    manager, copies = manager_with_copies()
    parent = new_request("p", 8)
    computed(manager, parent, 8)
    child = new_request("c", 8)
    manager.fork(parent, child)
    child.append_output_token(1)
    computed(manager, child, 1)
    assert copies == [] and manager.get_block_ids("c") == [1, 2, 3] and refs(manager) == {1: 2, 2: 2, 3: 1}


def test_a_copy_that_does_not_fit_changes_nothing():
    manager, copies = manager_with_copies(num_blocks=4)  # 3 usable blocks
    parent = new_request("p", 10)
    computed(manager, parent, 10)
    child = new_request("c", 10)
    manager.fork(parent, child)
    child.append_output_token(5)
    before = (refs(manager), manager.get_block_ids("c"), manager.num_free_blocks)
    assert manager.allocate_slots(child, 1) is None
    assert (refs(manager), manager.get_block_ids("c"), manager.num_free_blocks) == before and copies == []


def test_the_copy_moves_whole_blocks_of_every_layer():
    caches = [(torch.randn(6, BLOCK, 2, 8), torch.randn(6, BLOCK, 2, 8)) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    PagedBlockIO(caches).copy([2, 5], [4, 1])
    for (key, value), (old_key, old_value) in zip(caches, before, strict=True):
        assert torch.equal(key[4], old_key[2]) and torch.equal(value[1], old_value[5])
        assert torch.equal(key[2], old_key[2]) and torch.equal(key[3], old_key[3])


class ForkMachine(RuleBasedStateMachine):
    """Sequences fork, append and finish; the manager's tables are checked against the contents
    a real cache would hold (every computed token written to its slot, copies copying slots)."""

    @initialize(num_blocks=st.integers(4, 14), caching=st.booleans(), prompt=st.integers(1, 9))
    def setup(self, num_blocks, caching, prompt):
        self.manager = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
        self.slots: dict[int, list] = {i: [None] * BLOCK for i in range(num_blocks)}  # what each block holds
        self.manager.copy_blocks = self._copy
        self.live: list[Request] = []
        self.counter = 0
        first = new_request("s0", prompt)
        if self._compute(first, prompt):
            self.live.append(first)

    def _copy(self, source, destination):
        for s, d in zip(source, destination, strict=True):
            self.slots[d] = list(self.slots[s])

    def _compute(self, request: Request, num_new: int) -> bool:
        if self.manager.allocate_slots(request, num_new) is None:
            return False
        table = self.manager.get_block_ids(request.request_id)
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            self.slots[table[position // BLOCK]][position % BLOCK] = request.all_token_ids[position]
        request.num_computed_tokens += num_new
        return True

    @rule(prompt=st.integers(1, 9))
    def start(self, prompt):
        self.counter += 1
        request = new_request(f"s{self.counter}", prompt, start=self.counter * 10)
        if self._compute(request, prompt):
            self.live.append(request)
        else:
            self.manager.free(request)  # nothing was allocated: freeing an empty table is a no-op

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        self.counter += 1
        child = Request(f"s{self.counter}", list(parent.prompt_token_ids), parent.sampling_params)
        child.all_token_ids = list(parent.all_token_ids)
        self.manager.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data, count):
        request = data.draw(st.sampled_from(self.live))
        for _ in range(count):
            request.append_output_token(1000 + self.counter * 100 + request.num_tokens)
        if not self._compute(request, count):  # the pool is full: it stays as it was
            del request.all_token_ids[-count:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        request = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.manager.free(request)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for request in self.live:
            table = self.manager.get_block_ids(request.request_id)
            read = [self.slots[table[p // BLOCK]][p % BLOCK] for p in range(request.num_computed_tokens)]
            assert read == request.all_token_ids[: request.num_computed_tokens], request.request_id

    @invariant()
    def reference_counts_are_the_holders(self):
        holders: dict[int, int] = {}
        for request in self.live:
            for block_id in self.manager.get_block_ids(request.request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        pool = self.manager.block_pool
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt} == holders
        assert pool.num_free_blocks == pool.num_blocks - 1 - len(holders)
        assert pool.num_shared_references == sum(count - 1 for count in holders.values())


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
