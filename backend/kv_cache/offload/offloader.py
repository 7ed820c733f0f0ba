"""Spilling evicted prefix blocks to a tier and bringing them back, without stalling a step.

Out: when the block pool hands out a free block that still holds a cached prefix block, the pool
tells ``note_evicted``; before the step's forward pass overwrites it, ``capture`` copies the KV of
every block noted so far in one gather and queues them for the writer thread. The queue is
bounded (``queue_blocks``): when it is full a block is dropped and counted, never waited for.

Back: for a waiting request, the KV-cache manager asks ``available`` how many of the hashed blocks
after its pool hit the tier holds, ``worth_loading`` whether loading them beats recomputing them,
and ``load_async`` to read them on the reader thread while the request keeps its place in the
queue (the batch goes on without it). Loaded blocks are checked against the request's own tokens
and parent hashes before they are used.

The cost rule: recomputing ``b`` blocks costs their prefill, ``b * block_size / prefill rate``,
in the step the request would join now. Loading them costs the read, ``b * bytes_per_block /
read bandwidth``, during which the request waits in the queue: alone in the engine it joins the
first schedule after the read (the idle loop polls every few ms); beside a running batch it joins
the first step boundary after it, one step of that batch at least, so ``max(read, step)``. Never
read + a step: a step's duration follows its prefills, and with one long prompt prefilled per
step it equals the recompute it is weighed against, which made every load lose. Both rates are
measured while serving (the loads this offloader did, and the engine's prefill steps) and start
from conservative guesses, so short prefixes are recomputed. ``policy="always"`` loads whatever
the tier holds (for tests and for measuring both paths).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from backend.kv_cache.offload.block_io import PagedBlockIO
from backend.kv_cache.offload.tier import KVTier, StoredBlock

logger = logging.getLogger(__name__)

POLICIES = ("auto", "always")
# Starting guesses until measured: a local disk read and this CPU's prefill of a small model.
INITIAL_READ_BYTES_PER_SECOND = {"disk": 300e6, "host": 3e9}
INITIAL_PREFILL_TOKENS_PER_SECOND = 2000.0
INITIAL_STEP_SECONDS = 0.02
EMA = 0.2  # weight of a new measurement
MIN_PREFILL_TOKENS_TO_MEASURE = 64  # steps with fewer prompt tokens say little about prefill speed


@dataclass(slots=True)
class OffloadStats:
    """Cumulative counts (the Triton metrics take differences) and load times not yet reported."""

    stored_blocks: int = 0
    stored_bytes: int = 0
    dropped_blocks: int = 0  # the write queue was full
    restored_blocks: int = 0
    restored_bytes: int = 0
    hit_blocks: int = 0  # looked up after a pool miss and found in the tier
    miss_blocks: int = 0  # looked up after a pool miss and not in the tier
    recomputed_blocks: int = 0  # in the tier, but the cost rule chose recomputing
    load_seconds: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Noted:
    block_id: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class KVOffloader:
    """The asynchronous writer and reader between one block pool's cache and one tier."""

    def __init__(self, tier: KVTier, block_io: PagedBlockIO, block_size: int, queue_blocks: int = 256,
                 policy: str = "auto") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.tier = tier
        self.block_io = block_io
        self.block_size = block_size
        self.policy = policy
        self.stats = OffloadStats()
        self.read_bytes_per_second = INITIAL_READ_BYTES_PER_SECOND.get(tier.name, 300e6)
        self.prefill_tokens_per_second = INITIAL_PREFILL_TOKENS_PER_SECOND
        self.step_seconds = INITIAL_STEP_SECONDS
        self._noted: list[_Noted] = []
        self._in_flight: set[int] = set()  # hashes queued or being written
        self._lock = threading.Lock()
        self._queue: queue.Queue[StoredBlock | None] = queue.Queue(maxsize=max(1, queue_blocks))
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-reader")
        self._closed = False
        # From the writer thread: a block now in the tier, and the queue emptied (KV events use both).
        self.on_stored: Callable[[StoredBlock], None] | None = None
        self.on_idle: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    # ----- out -------------------------------------------------------------------------------------
    def note_evicted(self, block) -> None:
        """The pool is about to reuse ``block`` (a KVCacheBlock still holding its hash and KV)."""
        if block.block_hash is None or block.token_ids is None:
            return
        with self._lock:
            if block.block_hash in self._in_flight:
                return
        if block.block_hash in self.tier:
            return
        self._noted.append(_Noted(block.block_id, block.block_hash, block.parent_hash, block.token_ids))

    def capture(self, wait: bool = False) -> None:
        """Copies the noted blocks' KV and queues them; call before anything overwrites them.
        ``wait`` (shutdown only) waits for room in the queue instead of dropping."""
        if not self._noted:
            return
        noted, self._noted = self._noted, []
        kv = self.block_io.read([n.block_id for n in noted])  # [n, layers, 2, block_size, heads, head_size]
        for index, item in enumerate(noted):
            block = StoredBlock(item.block_hash, item.parent_hash, item.token_ids, kv[index].clone())
            with self._lock:
                if item.block_hash in self._in_flight:
                    continue
                self._in_flight.add(item.block_hash)
            try:
                self._queue.put(block, timeout=5.0) if wait else self._queue.put_nowait(block)
            except queue.Full:
                with self._lock:
                    self._in_flight.discard(item.block_hash)
                    self.stats.dropped_blocks += 1

    def _write_loop(self) -> None:
        while True:
            block = self._queue.get()
            if block is None:
                return
            try:
                if self.tier.store(block):
                    with self._lock:
                        self.stats.stored_blocks += 1
                        self.stats.stored_bytes += block.nbytes
                    if self.on_stored is not None:
                        self.on_stored(block)
            except Exception:
                logger.exception("KV offload: writing a block failed")
            finally:
                with self._lock:
                    self._in_flight.discard(block.block_hash)
                self._queue.task_done()
            if self.on_idle is not None and self._queue.empty():
                self.on_idle()

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until every queued block is written (tests, benchmarks, shutdown)."""
        self.capture()
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    # ----- back ------------------------------------------------------------------------------------
    def available(self, block_hashes: list[int]) -> int:
        """How many of ``block_hashes`` (consecutive, from the first) the tier holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.tier:
                break
            count += 1
        return count

    def worth_loading(self, num_blocks: int, batch_running: bool) -> bool:
        """Whether loading ``num_blocks`` beats recomputing them (the module docstring's rule);
        ``batch_running``: other requests are running, so the request waits for their steps."""
        if num_blocks <= 0:
            return False
        if self.policy == "always":
            return True
        read = num_blocks * self.block_io.bytes_per_block / self.read_bytes_per_second
        load = max(read, self.step_seconds) if batch_running else read
        recompute = num_blocks * self.block_size / self.prefill_tokens_per_second
        return load < recompute

    def load_async(self, expected: list[tuple[int, int | None, tuple[int, ...]]]) -> Future:
        """Reads the blocks (hash, parent hash, tokens) in order on the reader thread; the future's
        result is the verified prefix of them (shorter when one is missing, corrupt or foreign)."""
        return self._reader.submit(self._load, expected)

    def _load(self, expected: list[tuple[int, int | None, tuple[int, ...]]]) -> list[StoredBlock]:
        start = time.perf_counter()
        loaded = []
        for block_hash, parent_hash, token_ids in expected:
            block = self.tier.load(block_hash)
            if block is None or not block.matches(parent_hash, token_ids):
                break
            loaded.append(block)
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.load_seconds.append(seconds)
            if loaded and seconds > 0:
                rate = sum(b.nbytes for b in loaded) / seconds
                self.read_bytes_per_second += EMA * (rate - self.read_bytes_per_second)
        return loaded

    def observe_step(self, num_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """A step's size and duration: the rates of the cost rule follow them."""
        if seconds <= 0:
            return
        self.step_seconds += EMA * (seconds - self.step_seconds)
        if num_prefill_tokens >= MIN_PREFILL_TOKENS_TO_MEASURE:
            rate = num_tokens / seconds
            self.prefill_tokens_per_second += EMA * (rate - self.prefill_tokens_per_second)

    def take_load_seconds(self) -> list[float]:
        with self._lock:
            seconds, self.stats.load_seconds = self.stats.load_seconds, []
        return seconds

    def keep(self, blocks, seconds: float = 5.0) -> None:
        """Offloads ``blocks`` (cached KVCacheBlocks the pool still holds), waiting up to about
        ``seconds`` for them to be written: at shutdown the pool's cached prefixes would otherwise
        die with the process (whoever stops it waits 10 s for its last message)."""
        deadline = time.monotonic() + seconds
        blocks = list(blocks)
        for start in range(0, len(blocks), 64):
            if time.monotonic() > deadline:
                break
            for block in blocks[start:start + 64]:
                self.note_evicted(block)
            self.capture(wait=True)
        self.flush(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Writes what is queued (briefly) and stops the threads."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout=5.0)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass  # the daemon writer dies with the process
        self._reader.shutdown(wait=False, cancel_futures=True)
