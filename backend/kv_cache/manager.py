"""Per-request KV cache bookkeeping on top of the block pool: prefix hits, slot allocation, freeing.

Each request owns a block table (``req_to_blocks[request_id]``): block i holds the KV of tokens
``i * block_size .. (i + 1) * block_size - 1`` of ``request.all_token_ids``. The request itself
carries the cache's record of it (``request.kv``, backend/kv_cache/request_view.py: its block
hashes and how many of its blocks were offered to the cache, as in vLLM v1). With prefix caching,
the table starts with blocks shared with earlier requests (a hit), and every block that becomes
full of known tokens is hashed (chained to its parent's hash) and registered for later requests.

Same-step hits (invariant the attention backends must keep): a block is hashed when it is
allocated, before its KV is computed, so another request scheduled in the same step may hit it.
That is safe because every backend writes all new K/V of the step into the cache before any query
attends. It also means every scheduled step must be executed (see ``allocate_slots``).

Sliding windows (``sliding_window`` W > 0: every layer of the model slides, as in Mistral and
Mixtral checkpoints with ``sliding_window`` set): a query at position p reads keys p - W + 1 .. p
only, so before a request computes from position p, its blocks wholly before p - W + 1 are read by
no layer again. They are given back (the table keeps the null block in their place, as vLLM's
sliding-window manager does) and the request holds about ``W / block_size + 1`` blocks however long
it grows. A given-back block that was cached stays in the prefix cache until evicted; a prefix hit
still needs every block of the prefix cached, since the chain is verified from its first block.
A prefill engine (``transfer_server``) keeps every block: a pull reads the whole prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from operator import attrgetter

import torch

from backend.kv_cache.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from backend.kv_cache.offload.tier import StoredBlock
from backend.kv_cache.request_view import CachedSequence
from backend.models.shape import ceil_div


def live(blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
    """A block table's real blocks: without the null entries that stand for blocks a sliding
    window has passed (the pool never references or frees the null block)."""
    return [block for block in blocks if not block.is_null]


class KVCacheManager:
    """Allocates and frees block tables for requests; finds and registers cached prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, offloader=None,
                 sliding_window: int = 0) -> None:
        """``offloader`` (a KVOffloader, needs ``enable_caching``) adds the second tier: evicted
        cached blocks spill to it and come back on a later miss (``find_external``).
        ``sliding_window``: the window every layer of the model has (0: some layer is global)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_window_freed = 0  # blocks given back because the window had passed them
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.offloader = offloader if enable_caching else None
        # request id -> its load from the tier or a prefill engine (in flight or done, the index of
        # its first block, and whether it is a pull), or None once there is nothing to load
        self._restores: dict[str, tuple[Future, int, bool] | None] = {}
        if self.offloader is not None:
            self.block_pool.on_evict = self.offloader.note_evicted
        # Disaggregated serving (backend/kv_transfer), set by the engine: a decode engine's puller
        # brings a prompt's blocks from a prefill engine; a prefill engine's transfer server keeps a
        # finished prompt's blocks for that pull.
        self.puller = None
        self.transfer_server = None
        # Reads and writes whole blocks of every layer's cache (PagedBlockIO), set by the engine:
        # loaded blocks are written with it, and forked sequences copy-on-write with ``copy_blocks``.
        self.block_io = None
        self.copy_blocks = None
        self.num_copy_on_write = 0  # blocks copied so far
        self.share_forks = True  # False: a fork copies every block (a measuring baseline only)

    # ----- counters: the pool's, read through the manager -----------------------------------------
    num_blocks = property(attrgetter("block_pool.num_blocks"), doc="All blocks, the null block included.")
    num_free_blocks = property(attrgetter("block_pool.num_free_blocks"))
    usage = property(attrgetter("block_pool.usage"), doc="The share of usable blocks some request references.")
    prefix_queries = property(attrgetter("block_pool.prefix_queries"),
                              doc="Tokens looked up in the prefix cache so far (cumulative).")
    prefix_hits = property(attrgetter("block_pool.prefix_hits"), doc="Tokens found in the prefix cache so far (cumulative).")

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens (prompt + output) holds at once when
        it computes at most ``max_chunk`` tokens a step: all of them, or with a sliding window the
        blocks from the window's start to the chunk's end."""
        every_block = ceil_div(num_tokens, self.block_size)
        if not self.sliding_window:
            return every_block
        chunk = min(num_tokens, max_chunk)
        return min(every_block, (self.sliding_window + chunk - 2) // self.block_size + 2)


    # ----- hashing ------------------------------------------------------------------------------
    def block_hashes(self, request: CachedSequence, num_full_blocks: int) -> list[BlockHash]:
        """The request's block hashes, extended to at least ``num_full_blocks`` entries."""
        hashes = request.kv.block_hashes
        token_ids, size = request.all_token_ids, self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else request.kv.hash_root
            hashes.append(hash_block_tokens(parent, token_ids[i * size : (i + 1) * size]))
        return hashes

    # ----- prefix hits --------------------------------------------------------------------------
    def get_computed_blocks(self, request: CachedSequence) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks for ``request.all_token_ids`` and its length in
        tokens. Takes no references (``allocate_slots`` does). Counts one prefix query.

        Trap: a full hit would leave nothing to compute (and nothing to sample from), so at most
        ``num_tokens - 1`` tokens are a hit: the last block is dropped when needed.
        """
        if not self.enable_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # every prompt position must be computed to score it (as vLLM does)
        size = self.block_size
        max_num_blocks = (request.num_tokens - 1) // size
        hashes = self.block_hashes(request, max_num_blocks)
        token_ids = request.all_token_ids
        blocks: list[KVCacheBlock] = []
        for i in range(max_num_blocks):
            block = self.block_pool.get_cached_block(
                hashes[i - 1] if i else request.kv.hash_root, token_ids[i * size : (i + 1) * size], hashes[i]
            )
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * size
        self.block_pool.prefix_queries += request.num_tokens
        self.block_pool.prefix_hits += num_hit_tokens
        return blocks, num_hit_tokens

    # ----- blocks from elsewhere: the offload tier, a prefill engine -------------------------------
    def find_external(self, request: CachedSequence, computed_blocks: Sequence[KVCacheBlock],
                      batch_running: bool) -> list[StoredBlock] | None:
        """The blocks that continue ``request``'s pool hit ``computed_blocks`` from outside the pool: a
        prefill engine's (a ``do_remote_prefill`` request on a decode engine, pulled once) or the
        offload tier's. [] when there are none (or recomputing them is cheaper: ``batch_running``
        says whether other requests' steps would run while they load), None while they are being
        loaded (the request waits in the queue; ask again next step), else the loaded blocks,
        verified against the request's tokens, for ``allocate_slots`` to make room for and
        ``place_restored`` to write.
        """
        if request.sampling_params.prompt_logprobs is not None:
            return []  # every prompt position is computed to score it
        request_id, size = request.request_id, self.block_size
        start = len(computed_blocks)
        if request_id in self._restores:
            entry = self._restores[request_id]
            if entry is None:
                return []
            pending, first, _ = entry
            if not pending.done():
                return None
            loaded = pending.result() if pending.exception() is None else []
            if start < first:  # pool blocks before the loaded run were evicted meanwhile
                self._restores[request_id] = None
                return []
            return loaded[start - first:]  # the pool hit may have grown over part of the run
        max_num_blocks = (request.num_tokens - 1) // size  # a full hit would leave nothing to compute
        params = request.sampling_params.kv_transfer_params
        if self.puller is not None and params is not None and params.do_remote_prefill and not request.kv.remote_pull_done:
            return self._pull(request, params, start, max_num_blocks)
        offloader = self.offloader
        if offloader is None:
            return []
        if start >= max_num_blocks:
            self._restores[request_id] = None
            return []
        hashes = self.block_hashes(request, max_num_blocks)
        wanted = hashes[start:max_num_blocks]
        found = offloader.available(wanted)
        stats = offloader.stats
        stats.hit_blocks += found
        stats.miss_blocks += len(wanted) - found
        if not offloader.worth_loading(found, batch_running):
            stats.recomputed_blocks += found
            self._restores[request_id] = None
            return []
        self._restores[request_id] = (offloader.load_async(self._expected(request, start, start + found)), start, False)
        self._uncount_lookup(request, start)
        return None

    def _pull(self, request: CachedSequence, params, start: int, max_num_blocks: int) -> list[StoredBlock] | None:
        """Starts the request's one pull from its prefill engine (None: it waits for it). When the
        pool already holds every block it could use, the prefill engine is only told to let its
        blocks go, and the request runs at once ([])."""
        request.kv.remote_pull_done = True
        if start >= max_num_blocks:
            self.puller.pull_async(params, start, [])  # a release; nobody waits for its answer
            self._restores[request.request_id] = None
            return []
        expected = self._expected(request, start, max_num_blocks)
        self._restores[request.request_id] = (self.puller.pull_async(params, start, expected), start, True)
        self._uncount_lookup(request, start)
        return None

    def _expected(self, request: CachedSequence, first: int, end: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(hash, parent hash, tokens) of the request's blocks first..end-1: what a load must match."""
        hashes, token_ids, size = self.block_hashes(request, end), request.all_token_ids, self.block_size
        root = request.kv.hash_root
        return [(hashes[i], hashes[i - 1] if i else root, tuple(token_ids[i * size:(i + 1) * size]))
                for i in range(first, end)]

    def _uncount_lookup(self, request: CachedSequence, num_hit_blocks: int) -> None:
        """The lookup counts again when the request is admitted after its load: count it once."""
        self.block_pool.prefix_queries -= request.num_tokens
        self.block_pool.prefix_hits -= num_hit_blocks * self.block_size

    def restore_in_flight(self, request: CachedSequence) -> bool:
        """True while blocks are still being loaded for ``request``."""
        entry = self._restores.get(request.request_id)
        return entry is not None and not entry[0].done()

    def place_restored(self, request: CachedSequence, first_block: int, restored: Sequence[StoredBlock]) -> None:
        """Writes the loaded blocks into the request's blocks ``first_block..`` (allocated by
        ``allocate_slots`` just before, in the same schedule, so before any forward reads them)."""
        entry = self._restores.pop(request.request_id, None)
        if not restored:
            return
        if self.offloader is not None:
            self.offloader.capture()  # blocks noted as evicted may be the ones about to be overwritten
        blocks = self.req_to_blocks[request.request_id][first_block:first_block + len(restored)]
        self.block_io.write([b.block_id for b in blocks], torch.stack([b.kv for b in restored]))
        if entry is not None and not entry[2]:  # the tier's (pulls are counted by the puller)
            self.offloader.stats.restored_blocks += len(restored)
            self.offloader.stats.restored_bytes += sum(b.nbytes for b in restored)

    @property
    def has_pending_restores(self) -> bool:
        return any(entry is not None and not entry[0].done() for entry in self._restores.values())

    # ----- a prefill engine's kept blocks ----------------------------------------------------------
    def release_transferred(self) -> int:
        """Gives back the blocks a prefill engine kept for pulls that are done or timed out."""
        return 0 if self.transfer_server is None else self.transfer_server.take_released(self.block_pool)

    def reclaim_kept(self, num_blocks: int) -> bool:
        """The pool is short of ``num_blocks`` for running requests: blocks kept for pulls are given
        up first (oldest first). True when that freed any."""
        if self.transfer_server is None:
            return False
        return self.transfer_server.reclaim(self.block_pool, num_blocks) > 0

    # ----- forks (parallel sampling) -------------------------------------------------------------
    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """``child`` shares every block of ``parent`` (reference counts raised): the KV of the
        parent's computed tokens, which the child's tokens repeat. A later append to a shared
        partial block copies it first (``allocate_slots``), so neither sees the other's writes."""
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id}: already has blocks")
        blocks = list(self.req_to_blocks.get(parent.request_id, ()))
        if self.share_forks:
            self.block_pool.touch(live(blocks))
        else:  # the baseline that sharing is measured against (perf): private copies of every block
            originals = live(blocks)
            if len(originals) > self.block_pool.num_free_blocks:
                raise RuntimeError(f"fork without sharing needs {len(originals)} free blocks")
            copies = self.block_pool.get_new_blocks(len(originals))
            self.copy_blocks([b.block_id for b in originals], [b.block_id for b in copies])
            copied = iter(copies)
            blocks = [b if b.is_null else next(copied) for b in blocks]
        self.req_to_blocks[child.request_id] = blocks
        child.num_computed_tokens = parent.num_computed_tokens  # their KV is the child's too
        child.kv = parent.kv.forked()

    def _copy_on_write(self, request: CachedSequence, req_blocks: list[KVCacheBlock]) -> bool:
        """Before ``request`` appends into a partial block that another request also holds, it
        takes a private copy of it. False (nothing changed) when the pool has no block for that."""
        if not self._needs_copy(request, req_blocks):
            return True
        index = request.num_computed_tokens // self.block_size
        if self.block_pool.num_free_blocks < 1:
            return False
        if self.copy_blocks is None:
            raise RuntimeError("copy-on-write needs copy_blocks (the engine sets it)")
        shared = req_blocks[index]
        (private,) = self.block_pool.get_new_blocks(1)
        self.copy_blocks([shared.block_id], [private.block_id])
        self.block_pool.free_blocks([shared])
        req_blocks[index] = private
        self.num_copy_on_write += 1
        return True

    # ----- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self, request: CachedSequence, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens after the computed ones (and after the
        prefix hit ``new_computed_blocks``, which this references). Returns the newly allocated
        blocks, or None, changing nothing but the release of blocks a sliding window has passed,
        when the pool cannot provide them.

        Blocks that become full of known tokens are registered in the prefix cache right away:
        the caller must run the step it schedules (their KV is written during that step).
        """
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id, [])
        if new_computed_blocks and (req_blocks or request.num_computed_tokens):
            raise ValueError(f"request {request_id}: a prefix hit must start an empty block table")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_passed = self._num_passed_blocks(num_computed)
        if num_passed:
            self._release_passed(req_blocks, num_passed)
            # the hit's blocks the window has passed are not taken (null entries stand for them)
            num_skipped = min(num_passed, len(new_computed_blocks))
            new_computed_blocks = [self.block_pool.null_block] * num_skipped + list(new_computed_blocks[num_skipped:])
        num_required_blocks = ceil_div(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required_blocks - len(req_blocks) - len(new_computed_blocks), 0)
        # Free cached blocks the hit takes back leave the free queue: they are not available.
        num_hit_free = sum(1 for block in live(new_computed_blocks) if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_hit_free:
            return None
        if req_blocks and num_new_tokens > 0:  # a forked sequence appending to a shared block
            if num_new_blocks + 1 > self.block_pool.num_free_blocks and self._needs_copy(request, req_blocks):
                return None
            if not self._copy_on_write(request, req_blocks):
                return None

        # Touch the hit first so get_new_blocks cannot evict it.
        self.block_pool.touch(live(new_computed_blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_known_tokens = min(num_computed + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, req_blocks, num_known_tokens // self.block_size)
        return new_blocks

    def _num_passed_blocks(self, num_computed: int) -> int:
        """How many leading blocks no query from position ``num_computed`` on reads (0 without a
        sliding window, and on a prefill engine, whose pulls read every prompt block)."""
        window = self.sliding_window
        if not window or self.transfer_server is not None or num_computed < window:
            return 0
        return (num_computed - window + 1) // self.block_size

    def _release_passed(self, req_blocks: list[KVCacheBlock], num_passed: int) -> None:
        """Gives back the request's first ``num_passed`` blocks (the later first, so a cached
        prefix's tail is evicted before its head); null entries take their place."""
        passed = live(req_blocks[:num_passed])
        if not passed:
            return
        req_blocks[:num_passed] = [self.block_pool.null_block] * min(num_passed, len(req_blocks))
        self.block_pool.free_blocks(reversed(passed))
        self.num_window_freed += len(passed)

    def _needs_copy(self, request: CachedSequence, req_blocks: list[KVCacheBlock]) -> bool:
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        return offset != 0 and index < len(req_blocks) and req_blocks[index].ref_cnt > 1

    def _cache_full_blocks(self, request: CachedSequence, req_blocks: list[KVCacheBlock], num_full: int) -> None:
        start = request.kv.num_cached_blocks
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        token_ids, size = request.all_token_ids, self.block_size
        for i in range(start, num_full):
            block = req_blocks[i]
            if block.block_hash is not None or block.is_null:  # a prefix hit (already cached), or passed
                continue
            # Trap: cache a block only when its parent block is cached, so a cached block's
            # parent is always the table's entry for the parent hash (see BlockPool.cache_full_block).
            # A parent the window has passed may still be cached: the table then knows its hash.
            parent = req_blocks[i - 1] if i else None
            if parent is not None and parent.block_hash != hashes[i - 1] and not (
                    parent.is_null and hashes[i - 1] in self.block_pool.cached_block_hash_to_block):
                continue
            self.block_pool.cache_full_block(
                block, hashes[i - 1] if i else request.kv.hash_root, token_ids[i * size : (i + 1) * size], hashes[i]
            )
        request.kv.num_cached_blocks = num_full

    # ----- freeing ------------------------------------------------------------------------------
    def free(self, request: CachedSequence) -> None:
        """Frees the request's blocks, tail first (so its prefix stays cached longest)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._restores.pop(request.request_id, None)
        if self.transfer_server is not None and request.is_finished:  # may keep its prompt for a pull
            num_full = min(request.num_prompt_tokens, request.num_computed_tokens) // self.block_size
            self.transfer_server.keep_finished(request, blocks, self.block_hashes(request, num_full), self.block_pool)
        request.kv.num_cached_blocks = 0  # its hashes stay: they depend on its tokens alone
        self.block_pool.free_blocks(live(reversed(blocks)))

    def trim(self, request: CachedSequence, num_tokens: int) -> None:
        """Frees the request's blocks past the first ``num_tokens`` tokens (tail first): the
        rollback of rejected speculative tokens. Those blocks were never hashed (only blocks full
        of known tokens are), so nothing enters the prefix cache with a rejected token's KV."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = ceil_div(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(live(reversed(tail)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a new list)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
