"""Decode-kernel microbenchmark: achieved memory bandwidth as a fraction of the device's peak.

Decode attention is memory-bound: each step reads every context token's K and V once per kv head.
"Achieved" counts those bytes (K/V of all contexts, queries and outputs are negligible) over the
kernel time, measured with CUDA events. The peak is the theoretical one from the memory clock and
bus width where the driver reports them, and a device-to-device copy measured here (what the
memory system actually sustains). Prints one line per shape; asserts only a floor that catches a
broken kernel (e.g. uncoalesced reads), not a tuning target.
"""

from __future__ import annotations

import math

import pytest
import torch

from backend.attention.cupy_backend import CupyAttentionBackend

CUDA = torch.device("cuda")
# (name, num_seqs, context_len, num_heads, num_kv_heads, head_size, dtype)
SHAPES = [
    ("llama8b-gqa4-ctx4096", 64, 4096, 32, 8, 128, torch.float16),
    ("llama8b-gqa4-ctx512", 256, 512, 32, 8, 128, torch.bfloat16),
    ("mha-ctx2048-h64", 64, 2048, 16, 16, 64, torch.float16),
]
FLOOR = 0.2  # of the measured copy bandwidth


def theoretical_peak_bytes_per_s() -> float | None:
    """2 x memory clock x bus width, from the driver (None where it does not report them)."""
    try:
        import cupy

        dev = torch.cuda.current_device()
        clock_khz = cupy.cuda.runtime.deviceGetAttribute(36, dev)  # cudaDevAttrMemoryClockRate
        bus_bits = cupy.cuda.runtime.deviceGetAttribute(37, dev)  # cudaDevAttrGlobalMemoryBusWidth
        if clock_khz > 0 and bus_bits > 0:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8
    except Exception:
        pass
    return None


def time_cuda(fn, iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call of fn, by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


@pytest.fixture(scope="module")
def copy_bandwidth(_needs_cupy_and_a_gpu) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.float16, device=CUDA)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() * src.element_size() / seconds


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_decode_bandwidth(shape, copy_bandwidth, capsys):
    name, num_seqs, context_len, num_heads, num_kv_heads, head_size, dtype = shape
    block_size = 16
    blocks_per_seq = math.ceil(context_len / block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    g = torch.Generator(device=CUDA).manual_seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=g, device=CUDA).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g, device=CUDA).to(dtype)
    block_tables = (torch.randperm(num_blocks - 1, device=CUDA) + 1)[: num_seqs * blocks_per_seq]
    block_tables = block_tables.view(num_seqs, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=CUDA)
    query = torch.randn((num_seqs, num_heads, head_size), generator=g, device=CUDA).to(dtype)
    out = torch.empty_like(query)
    backend = CupyAttentionBackend(CUDA, head_size=head_size, dtype=dtype)

    def step():
        backend.decode_into(
            out, query, key_cache, value_cache, block_tables, seq_lens, head_size**-0.5, context_len
        )

    seconds = time_cuda(step)
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_size * key_cache.element_size()
    achieved = kv_bytes / seconds
    peak = theoretical_peak_bytes_per_s()
    peak_text = f"{achieved / peak:.0%} of the {peak / 1e12:.2f} TB/s peak, " if peak else ""
    with capsys.disabled():
        print(
            f"\n[decode bandwidth] {torch.cuda.get_device_name()} {name}: {seconds * 1e6:.0f} us, "
            f"{achieved / 1e12:.2f} TB/s = {peak_text}{achieved / copy_bandwidth:.0%} of a measured "
            f"{copy_bandwidth / 1e12:.2f} TB/s device copy"
        )
    assert achieved > FLOOR * copy_bandwidth
