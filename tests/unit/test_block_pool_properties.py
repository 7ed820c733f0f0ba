"""Hypothesis state machines over random operation sequences of the block pool and the manager.

Invariants: free + used = total usable blocks; no negative ref_cnt; a block is in the free queue
iff its ref_cnt is 0; every block of a block table has ref_cnt > 0 (exactly its number of
holders); the cache table and block hashes agree; a cached block's parent is cached; and a prefix
hit only ever returns blocks whose (simulated) KV belongs to the request's own prefix.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.engine.request import Request
from backend.kv_cache.block_pool import BlockPool
from backend.kv_cache.manager import KVCacheManager
from backend.protocol.sampling import SamplingParams

SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool against a model: per-block holder counts and the expected LRU free order."""

    @initialize(num_blocks=st.integers(2, 9))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.model_ref = {i: 0 for i in range(1, num_blocks)}
        self.model_free = list(range(1, num_blocks))  # LRU head first
        self.held: list[list[int]] = []  # block id lists, one per simulated owner

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > len(self.model_free):
            try:
                self.pool.get_new_blocks(n)
            except ValueError:
                return
            raise AssertionError("over-allocation must raise")
        blocks = self.pool.get_new_blocks(n)
        expected, self.model_free = self.model_free[:n], self.model_free[n:]
        assert [b.block_id for b in blocks] == expected
        for block_id in expected:
            self.model_ref[block_id] = 1
        self.held.append(expected)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data):
        """A prefix hit: another owner references a (prefix of a) held list."""
        ids = data.draw(st.sampled_from(self.held))
        ids = ids[: data.draw(st.integers(0, len(ids)))]
        self.pool.touch([self.pool.blocks[i] for i in ids])
        for block_id in ids:
            if self.model_ref[block_id] == 0:
                self.model_free.remove(block_id)
            self.model_ref[block_id] += 1
        self.held.append(list(ids))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        ids = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free_blocks([self.pool.blocks[i] for i in reversed(ids)])
        for block_id in reversed(ids):
            self.model_ref[block_id] -= 1
            if self.model_ref[block_id] == 0:
                self.model_free.append(block_id)

    @rule(block_id=st.integers(1, 8))
    def double_free(self, block_id):
        if block_id in self.model_ref and self.model_ref[block_id] == 0:
            try:
                self.pool.free_blocks([self.pool.blocks[block_id]])
            except ValueError:
                return
            raise AssertionError("double free must raise")

    @invariant()
    def matches_model(self):
        pool = self.pool
        assert [b.block_id for b in pool.free_block_queue] == self.model_free
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == self.model_ref
        assert pool.num_free_blocks + sum(1 for r in self.model_ref.values() if r > 0) == pool.num_blocks - 1
        assert pool.null_block.ref_cnt == 0 and pool.null_block not in pool.free_block_queue


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Requests with tiny vocabularies (lots of shared prefixes) admitted, chunked, decoded,
    preempted and freed at random over a small pool, with a simulated KV cache."""

    @initialize(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 3]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.manager = KVCacheManager(num_blocks, block_size, caching)
        self.block_size = block_size
        self.live: dict[str, Request] = {}
        self.kv: dict[int, int] = {}  # slot -> hash of the token prefix computed there
        self.next_id = 0

    def _slot(self, request, pos):
        block_ids = self.manager.get_block_ids(request.request_id)
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _compute(self, request, num_new):
        """Runs a step for the request: writes the KV of its new tokens, checks the older ones."""
        start = request.num_computed_tokens
        tokens = request.all_token_ids
        for pos in range(start, start + num_new):
            self.kv[self._slot(request, pos)] = hash(tuple(tokens[: pos + 1]))
        request.num_computed_tokens += num_new
        for pos in range(request.num_computed_tokens):
            assert self.kv.get(self._slot(request, pos)) == hash(tuple(tokens[: pos + 1]))

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=10), chunk=st.integers(1, 10))
    def admit(self, tokens, chunk):
        request = Request(str(self.next_id), tokens, SamplingParams())
        self.next_id += 1
        hit, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit == len(hit) * self.block_size and num_hit < request.num_tokens
        num_new = min(chunk, request.num_tokens - num_hit)
        if self.manager.allocate_slots(request, num_new, hit) is None:
            self.manager.free(request)  # drops the hashes get_computed_blocks stored
            return
        request.num_computed_tokens = num_hit
        self.live[request.request_id] = request
        self._compute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1), chunk=st.integers(1, 10))
    def step(self, data, token, chunk):
        """Next chunk of the prompt, or one decode token; preempt (free) on a full pool."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.manager.allocate_slots(request, num_new) is None:
            self.manager.free(request)
            del self.live[request.request_id]
            return
        self._compute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.manager.free(request)

    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache()

    @invariant()
    def accounting(self):
        pool = self.manager.block_pool
        holders = {block.block_id: 0 for block in pool.blocks}
        for request_id, blocks in self.manager.req_to_blocks.items():
            assert request_id in self.live
            request = self.live[request_id]
            assert len(blocks) == -(-request.num_computed_tokens // self.block_size)
            assert len({b.block_id for b in blocks}) == len(blocks)
            for block in blocks:
                assert block.ref_cnt > 0 and not block.is_null
                holders[block.block_id] += 1
        assert set(self.manager.req_to_blocks) == set(self.live)
        in_queue = {block.block_id for block in pool.free_block_queue}
        num_used = 0
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id] >= 0
            assert (block.block_id in in_queue) == (block.ref_cnt == 0)
            num_used += block.ref_cnt > 0
        assert pool.num_free_blocks + num_used == pool.num_blocks - 1
        assert pool.num_free_blocks == len(in_queue)
        assert pool.null_block.ref_cnt == 0 and 0 not in in_queue

    @invariant()
    def cache_table(self):
        pool = self.manager.block_pool
        hashed = {block.block_hash: block for block in pool.blocks if block.block_hash is not None}
        assert hashed == pool.cached_block_hash_to_block
        for block in hashed.values():
            assert len(block.token_ids) == self.block_size
            # Chain invariant: a cached block's parent is cached, so verifying each step of a
            # lookup verifies the whole prefix.
            assert block.parent_hash is None or block.parent_hash in hashed
        if not self.manager.enable_caching:
            assert not hashed and self.manager.prefix_queries == 0


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = SETTINGS
TestKVCacheManager = KVCacheManagerMachine.TestCase
TestKVCacheManager.settings = SETTINGS
