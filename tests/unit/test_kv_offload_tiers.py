"""The KV offload tiers and the offloader's queue, without an engine (issue 19).

Blocks round-trip bit-exactly through the host and disk tiers (float32 and bfloat16); the disk
tier keeps its blocks across a restart, removes what fails a check (altered, truncated, another
fingerprint) without loading it, and holds its capacity with LRU eviction; a full write queue
drops blocks without making the caller wait; whole blocks round-trip through the paged cache.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from backend.kv_cache.block_pool import KVCacheBlock, hash_block_tokens
from backend.kv_cache.offload.block_io import PagedBlockIO
from backend.kv_cache.offload.disk_tier import DiskTier, file_name
from backend.kv_cache.offload.offloader import KVOffloader
from backend.kv_cache.offload.tier import HostMemoryTier, StoredBlock

SHAPE = (3, 2, 4, 2, 8)  # [layers, key/value, block_size, kv heads, head size]


def block(index: int, dtype=torch.float32) -> StoredBlock:
    tokens = tuple(range(index * 4, index * 4 + 4))
    parent = None if index == 0 else hash_block_tokens(None, (index,))
    generator = torch.Generator().manual_seed(index)
    return StoredBlock(hash_block_tokens(parent, tokens), parent, tokens,
                       torch.randn(SHAPE, generator=generator).to(dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def make_tier(kind: str, tmp_path, capacity: int = 1 << 20, fingerprint: str = "f" * 64):
    return HostMemoryTier(capacity) if kind == "host" else DiskTier(tmp_path, capacity, fingerprint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_blocks_round_trip_bit_exactly(tmp_path, kind, dtype):
    tier = make_tier(kind, tmp_path)
    blocks = [block(i, dtype) for i in range(5)]
    for stored in blocks:
        assert tier.store(stored)
    assert len(tier) == 5 and all(b.block_hash in tier for b in blocks)
    for stored in blocks:
        loaded = tier.load(stored.block_hash)
        assert loaded is not None and same_bits(loaded.kv, stored.kv)
        assert loaded.matches(stored.parent_hash, stored.token_ids)
    assert tier.load(12345) is None


def test_the_disk_tier_keeps_its_blocks_across_a_restart_and_ignores_other_fingerprints(tmp_path):
    first = DiskTier(tmp_path, 1 << 20, "a" * 64)
    blocks = [block(i) for i in range(3)]
    for stored in blocks:
        first.store(stored)
    again = DiskTier(tmp_path, 1 << 20, "a" * 64)
    assert len(again) == 3 and again.used_bytes == first.used_bytes
    assert same_bits(again.load(blocks[1].block_hash).kv, blocks[1].kv)
    other = DiskTier(tmp_path, 1 << 20, "b" * 64)  # another model (or dtype, or block size): its own folder
    assert len(other) == 0 and other.load(blocks[1].block_hash) is None
    assert len(DiskTier(tmp_path, 1 << 20, "a" * 64)) == 3  # and ours was left alone


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "another fingerprint", "garbage"])
def test_a_damaged_or_foreign_block_file_is_removed_and_never_loaded(tmp_path, damage):
    tier = DiskTier(tmp_path, 1 << 20, "a" * 64)
    good, bad = block(0), block(1)
    tier.store(good)
    tier.store(bad)
    path = tier.folder / file_name(bad.block_hash)
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-7] ^= 0x40
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "another fingerprint":
        foreign = DiskTier(tmp_path / "elsewhere", 1 << 20, "c" * 64)
        foreign.store(bad)
        data = bytearray((foreign.folder / file_name(bad.block_hash)).read_bytes())
    else:
        data = bytearray(b"not a block at all")
    path.write_bytes(bytes(data))
    assert tier.load(bad.block_hash) is None
    assert not path.exists() and bad.block_hash not in tier and tier.num_rejected == 1
    assert same_bits(tier.load(good.block_hash).kv, good.kv)  # the others are untouched


def test_the_disk_tier_holds_its_capacity_least_recently_used_first(tmp_path):
    probe = DiskTier(tmp_path / "probe", 1 << 20, "a" * 64)
    probe.store(block(4))
    size = probe.used_bytes  # files differ by a few header bytes: room for 3, never 4
    capacity = 3 * size + size // 2
    tier = DiskTier(tmp_path, capacity, "a" * 64)
    blocks = [block(i) for i in range(5)]
    for stored in blocks[:3]:
        tier.store(stored)
    tier.load(blocks[0].block_hash)  # block 0 is now the most recent: 1 goes first
    tier.store(blocks[3])
    assert [b.block_hash in tier for b in blocks[:4]] == [True, False, True, True]
    assert tier.used_bytes <= capacity and len(os.listdir(tier.folder)) == 3
    time.sleep(0.01)  # file times order the LRU across a restart
    tier.load(blocks[2].block_hash)
    restarted = DiskTier(tmp_path, capacity, "a" * 64)
    restarted.store(blocks[4])  # 0 is now the least recently used on disk
    assert [b.block_hash in restarted for b in blocks] == [False, False, True, True, True]


def test_the_host_tier_holds_its_capacity_least_recently_used_first():
    size = block(0).nbytes
    tier = HostMemoryTier(2 * size)
    a, b, c = block(0), block(1), block(2)
    tier.store(a)
    tier.store(b)
    tier.load(a.block_hash)
    tier.store(c)
    assert (a.block_hash in tier, b.block_hash in tier, c.block_hash in tier) == (True, False, True)
    assert tier.used_bytes == 2 * size


def paged_cache(num_blocks: int = 6):
    layers, _, block_size, heads, head_size = SHAPE
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(num_blocks, block_size, heads, head_size, generator=generator),
             torch.randn(num_blocks, block_size, heads, head_size, generator=generator)) for _ in range(layers)]


def test_paged_block_io_reads_and_writes_whole_blocks():
    caches = paged_cache()
    io = PagedBlockIO(caches)
    assert io.block_shape == SHAPE[:1] + (2,) + SHAPE[2:]
    kv = io.read([4, 1])
    assert kv.shape == (2, *SHAPE)
    assert torch.equal(kv[0, 2, 0], caches[2][0][4]) and torch.equal(kv[1, 0, 1], caches[0][1][1])
    io.write([2, 5], kv)
    assert torch.equal(caches[1][0][2], caches[1][0][4]) and torch.equal(caches[2][1][5], caches[2][1][1])
    with pytest.raises(ValueError, match="block shape"):
        io.write([3], kv[:, :2])


class SlowTier(HostMemoryTier):
    """A tier whose writes wait for a gate: the writer thread stays busy."""

    def __init__(self):
        super().__init__(1 << 30)
        self.gate = threading.Event()

    def store(self, stored):
        self.gate.wait(10)
        return super().store(stored)


def cached_block(block_id: int, index: int) -> KVCacheBlock:
    stored = block(index)
    return KVCacheBlock(block_id, ref_cnt=0, block_hash=stored.block_hash, parent_hash=stored.parent_hash,
                        token_ids=stored.token_ids)


def test_a_full_write_queue_drops_blocks_without_waiting():
    tier = SlowTier()
    offloader = KVOffloader(tier, PagedBlockIO(paged_cache()), block_size=4, queue_blocks=2)
    for block_id in range(1, 6):
        offloader.note_evicted(cached_block(block_id, block_id))
    started = time.perf_counter()
    offloader.capture()
    assert time.perf_counter() - started < 0.5  # the writer is stuck; capture is not
    # the writer holds one, the queue two: the other two are dropped and counted
    assert offloader.stats.dropped_blocks >= 2
    tier.gate.set()
    offloader.flush()
    assert offloader.stats.stored_blocks + offloader.stats.dropped_blocks == 5 == len(tier) + offloader.stats.dropped_blocks
    offloader.close()


def test_a_block_already_in_the_tier_is_not_written_again():
    tier = HostMemoryTier(1 << 30)
    offloader = KVOffloader(tier, PagedBlockIO(paged_cache()), block_size=4)
    offloader.note_evicted(cached_block(1, 1))
    offloader.flush()
    offloader.note_evicted(cached_block(3, 1))  # the same prefix block, evicted again later
    offloader.flush()
    assert offloader.stats.stored_blocks == 1 and len(tier) == 1
    offloader.close()


def test_the_cost_rule_recomputes_short_prefixes_and_loads_long_ones():
    offloader = KVOffloader(HostMemoryTier(1 << 30), PagedBlockIO(paged_cache()), block_size=16)
    offloader.read_bytes_per_second, offloader.step_seconds = 1e9, 0.02
    offloader.prefill_tokens_per_second = 2000.0
    assert not offloader.worth_loading(0, batch_running=True)
    assert not offloader.worth_loading(1, batch_running=True)  # 16 tokens: 8 ms to recompute, a step's wait to load
    assert offloader.worth_loading(1, batch_running=False)  # alone in the engine: the read, 0.4 ms, only
    assert offloader.worth_loading(100, batch_running=True)  # 1,600 tokens: 0.8 s to recompute
    offloader.observe_step(num_tokens=5000, num_prefill_tokens=5000, seconds=0.01)  # a very fast prefill
    for _ in range(30):
        offloader.observe_step(5000, 5000, 0.01)
    assert not offloader.worth_loading(100, batch_running=True)  # recomputing is cheaper than a step now
    assert offloader.worth_loading(100, batch_running=False)  # but not than the read alone
    offloader.read_bytes_per_second = 1e3  # a very slow read
    assert not offloader.worth_loading(100, batch_running=False)
    offloader.policy = "always"
    assert offloader.worth_loading(1, batch_running=True)
    offloader.close()


def test_a_long_prompt_prefilled_in_one_step_is_still_worth_loading():
    """Steps as long as one whole prefill (one ~1,400-token prompt per step, the default budget): the
    wait for a step is not added to the read, so the load still wins, alone or beside a batch whose
    steps are shorter than the prefill."""
    offloader = KVOffloader(HostMemoryTier(1 << 30), PagedBlockIO(paged_cache()), block_size=16)
    offloader.read_bytes_per_second = 300e6
    for _ in range(30):
        offloader.observe_step(num_tokens=1400, num_prefill_tokens=1400, seconds=1.0)
    assert offloader.step_seconds == pytest.approx(1.0, abs=0.01)
    bytes_per_block = offloader.block_io.bytes_per_block
    num_blocks = 87  # a 1,400-token prompt: 1 s to recompute at the measured 1,400 tokens/s
    assert num_blocks * bytes_per_block / offloader.read_bytes_per_second < 0.5
    assert offloader.worth_loading(num_blocks, batch_running=False)
    offloader.step_seconds = 0.3  # a running batch's decode steps
    assert offloader.worth_loading(num_blocks, batch_running=True)
    offloader.step_seconds = 1.2  # beside a batch whose steps outlast the prefill, recomputing wins
    assert not offloader.worth_loading(num_blocks, batch_running=True)
    offloader.close()
