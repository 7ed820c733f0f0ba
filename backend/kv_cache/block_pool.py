"""The physical KV cache blocks: reference counts, an O(1) LRU free queue and the prefix-cache table.

A block is *free* when no request references it (``ref_cnt == 0``); it then sits in the free queue.
A free block may still be *cached*: it keeps its ``block_hash`` and KV (lazy eviction) until
``get_new_blocks`` hands it out again, so a later request with the same prefix can take it back
with ``touch``. Blocks are freed in eviction order (callers pass a request's blocks reversed), so
the free queue evicts a prefix tail before its head.

Block 0 is the null block: block tables are padded with it, its ``ref_cnt`` is never counted, it is
never in the free queue and never handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from backend.kv_cache.kv_events import KVEventLog

BlockHash = NewType("BlockHash", int)

NULL_BLOCK_ID = 0

# Parent hash of a request's first block (any fixed int; it just anchors the chain).
_ROOT_HASH = 0x6B76_6361_6368_6521


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block, chained to its parent's so equal blocks after different
    prefixes differ. A hash is only a lookup key: hits are verified against the stored tokens."""
    parent = _ROOT_HASH if parent_hash is None else parent_hash
    return BlockHash(hash((parent, tuple(token_ids))))


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is in the prefix-cache table (a full block of known tokens).
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None  # block_hash of the previous block in its request
    token_ids: tuple[int, ...] | None = None  # this block's tokens, to verify hits
    # Free-queue links; both None when the block is not in the free queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def reset_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction (LRU) order: the head is evicted first.

    popleft, remove (from anywhere, when a prefix hit takes a cached free block back) and append
    are O(1). Sentinel head/tail nodes keep the link code branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1


class BlockPool:
    """All KV cache blocks, their reference counts and the prefix-cache table.

    Invariants: a block is in the free queue iff ``ref_cnt == 0`` (the null block is in neither);
    a block has a ``block_hash`` iff the table maps that hash to it (the table never holds two
    blocks for one hash: the first registration wins).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Called with a cached block about to be reused (its hash and KV still intact): the
        # offload tier's chance to keep it (backend/kv_cache/offload/offloader.py).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        # KV-cache events for routers (backend/kv_cache/kv_events.py); None: nobody listens.
        self.events: KVEventLog | None = None
        # Prefix-cache statistics in tokens; the KV cache manager updates them.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # References beyond the first on referenced blocks: the blocks that sharing (prefix hits,
        # forked sequences) saves against every request holding its own copy.
        self.num_shared_references = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references, cached or not (all can be handed out)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks some request references."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.num_free_blocks) / num_usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the LRU head of the free queue, each with ref_cnt 1.

        A reused block loses its cached identity (its KV is about to be overwritten).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        # Trap: drop the table entry only if it still points to this block; another block with
        # the same hash may own it (a stale hash must not evict a live entry).
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.reset_hash()

    def get_cached_block(
        self, parent_hash: BlockHash | None, token_ids: Sequence[int], block_hash: BlockHash | None = None
    ) -> KVCacheBlock | None:
        """The cached block holding ``token_ids`` after the block hashed ``parent_hash``, or None.

        ``block_hash`` may be passed when the caller already computed it. A hit is verified
        against the stored parent hash and tokens, so a hash collision is only ever a miss.
        """
        if not self.enable_caching:
            return None
        if block_hash is None:
            block_hash = hash_block_tokens(parent_hash, token_ids)
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(
        self,
        block: KVCacheBlock,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_hash: BlockHash | None = None,
    ) -> bool:
        """Registers a full block in the prefix-cache table; False when caching is off or another
        block already owns the hash (a duplicate computed concurrently, or a collision).

        Trap: only register a block whose parent block is itself cached (the manager ensures
        it). Together with tail-first freeing this keeps every cached block's parent cached, so
        verifying (parent_hash, tokens) at each step of a chain lookup verifies the whole prefix.
        """
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached")
        if block.ref_cnt <= 0 or block.is_null:
            raise ValueError(f"block {block.block_id} is not allocated")
        if block_hash is None:
            block_hash = hash_block_tokens(parent_hash, token_ids)
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self.cached_block_hash_to_block[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, block.token_ids)
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes one more reference on each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.is_null:
                raise ValueError("the null block is never referenced")
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            else:
                self.num_shared_references += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block; blocks reaching 0 join the free queue tail in the
        given order, which is therefore their eviction order (pass a request's blocks reversed).

        Raises ValueError on a double free (ref_cnt already 0), before changing anything.
        """
        blocks = list(ordered_blocks)
        pending: dict[int, int] = {}
        for block in blocks:
            pending[block.block_id] = pending.get(block.block_id, 0) + 1
            if block.is_null or pending[block.block_id] > block.ref_cnt:
                raise ValueError(f"double free of block {block.block_id} (ref_cnt {block.ref_cnt})")
        for block in blocks:
            if block.ref_cnt > 1:
                self.num_shared_references -= 1
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                # Lazy eviction: the block keeps its hash and KV until get_new_blocks reuses it.
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (e.g. after new weights). Blocks in use keep their KV for
        their owners but are no longer shared; their later full blocks are not cached either."""
        for block in self.cached_block_hash_to_block.values():
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
