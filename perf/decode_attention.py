"""Decode attention alone: the torch backend (gather + SDPA) against the CPU paged kernel, side by side.

One layer's decode attention of ``--batch`` sequences over contexts of each ``--contexts`` length
(every sequence the same length, and a mixed row with lengths uniform over 16..max), in float32
and bfloat16, for the demo model's heads (8 query / 2 KV heads of 64) and SmolLM2's (9 / 3 of 64).
Both backends see the same shuffled block tables; each cell is the median of ``--repeat`` timed
calls after a warm-up, and the kernel's output is checked against torch's first.

    .venv/bin/python -m perf.decode_attention [--batch 32] [--contexts 128,512,2048] [--repeat 30]
    .venv/bin/python -m perf.decode_attention --cold
    .venv/bin/python -m perf.decode_attention --prefill

``--cold`` times the kernel alone as a decode step sees it: a 1 GiB bf16 cache per K and V with
each sequence's blocks spread over all of it, and 64 MB of other memory written between calls so
the K/V come from DRAM (against the same call with warm caches).

``--prefill`` times prefill attention instead: the torch backend's SDPA (CPU flash attention, per
sequence, over a gathered context when there is a cached prefix) against the CPU prefill kernel, for
whole prompts and for chunks after a cached prefix, one layer, both dtypes, SmolLM2's heads.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

from backend.attention.base import AttentionMetadata
from backend.attention.cpu_backend import CpuAttentionBackend, paged_decode
from backend.attention.cpu_kernel.build import load_kernel
from backend.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 16
MODELS = {"demo": (8, 2, 64), "smollm2": (9, 3, 64)}


def make_step(seq_lens: list[int], heads: tuple[int, int, int], dtype: torch.dtype, seed: int,
              query_lens: list[int] | None = None):
    """Random caches over shuffled block tables, the queries of each sequence's last ``query_lens``
    tokens (default: one, a decode) and the step's metadata."""
    num_heads, num_kv_heads, head_size = heads
    query_lens = query_lens or [1] * len(seq_lens)
    rng = random.Random(seed)
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = list(range(1, sum(needed) + 1))
    rng.shuffle(ids)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    cache_shape = (sum(needed) + 1, BLOCK_SIZE, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape).to(dtype)
    value_cache = torch.randn(cache_shape).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_size).to(dtype)
    slots = torch.tensor([int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)) for p in range(n - q, n)],
                         dtype=torch.int64)
    metadata = AttentionMetadata.build(slots, tables, seq_lens, query_lens)
    return query, key_cache, value_cache, metadata


def time_decode(backend, query, key_cache, value_cache, metadata, repeat: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of plan + decode (what a step pays once per layer), and the output."""
    scale = query.shape[-1] ** -0.5
    times, out = [], None
    for i in range(repeat + 3):
        start = time.perf_counter()
        plan = backend.plan_step(metadata, BLOCK_SIZE, query.dtype)
        out = backend.decode(query, key_cache, value_cache, metadata, plan, scale)
        if i >= 3:
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), out


def cold_cache(kernel, batch: int, repeat: int) -> int:
    """Warm against cold K/V for the kernel alone (see the module docstring)."""
    num_heads, num_kv_heads, head_size = MODELS["smollm2"]
    dtype = torch.bfloat16
    num_blocks = (1 << 30) // (BLOCK_SIZE * num_kv_heads * head_size * 2)
    key_cache = torch.empty(num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype).normal_()
    value_cache = torch.empty_like(key_cache).normal_()
    other = torch.ones(64 << 20, dtype=torch.uint8)
    rng = random.Random(0)
    seq_len = 200
    tables = torch.tensor([[rng.randrange(1, num_blocks) for _ in range(-(-seq_len // BLOCK_SIZE))]
                           for _ in range(batch)], dtype=torch.int32)
    lens = torch.full((batch,), seq_len, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_size).to(dtype)
    kv_bytes = batch * seq_len * num_kv_heads * head_size * 2 * 2
    print(f"kernel alone, SmolLM2 heads, bf16, {batch} x {seq_len} tokens ({kv_bytes / 1e6:.1f} MB of K/V), "
          f"blocks spread over a 1 GiB cache; median of {repeat}")
    print("| caches | ms | GB/s of K/V |\n| --- | ---: | ---: |")
    for cold in (False, True):
        times = []
        for _ in range(repeat + 3):
            if cold:
                other.add_(1)  # evicts the K/V from every cache level
            start = time.perf_counter()
            paged_decode(kernel, query, key_cache, value_cache, tables, lens, head_size ** -0.5)
            times.append((time.perf_counter() - start) * 1000)
        ms = statistics.median(times[3:])
        print(f"| {'cold (from memory)' if cold else 'warm'} | {ms:.3f} | {kv_bytes / ms / 1e6:.1f} |")
    return 0


PREFILL_SHAPES = ((64, 64), (269, 269), (512, 512), (1024, 512), (2048, 64))  # (context, new tokens)


def prefill(kernel, repeat: int) -> int:
    """SDPA against the prefill kernel, one sequence per row (see the module docstring)."""
    num_heads, num_kv_heads, head_size = MODELS["smollm2"]
    print(f"prefill attention, one layer, SmolLM2 heads {num_heads}/{num_kv_heads} x {head_size}, torch threads "
          f"{torch.get_num_threads()}; median of {repeat} calls (plan + attention)")
    print("| dtype | context | new tokens | torch SDPA ms | cpu kernel ms | speed-up | kernel GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in (torch.bfloat16, torch.float32):
        for context, new in PREFILL_SHAPES:
            query, key_cache, value_cache, metadata = make_step([context], MODELS["smollm2"], dtype, seed=context,
                                                                query_lens=[new])
            key = torch.randn(new, num_kv_heads, head_size).to(dtype)
            value = torch.randn(new, num_kv_heads, head_size).to(dtype)
            results = {}
            for name, backend in (("torch", TorchAttentionBackend("cpu")), ("kernel", CpuAttentionBackend(kernel))):
                times = []
                for i in range(repeat + 2):
                    step = copy.copy(metadata)  # a new step's metadata: planned afresh, as each step is
                    start = time.perf_counter()
                    out = backend.forward(query, key, value, key_cache, value_cache, step, head_size**-0.5)
                    if i >= 2:
                        times.append((time.perf_counter() - start) * 1000)
                results[name] = (statistics.median(times), out)
            difference = (results["torch"][1].float() - results["kernel"][1].float()).abs().max().item()
            assert difference < (1e-4 if dtype == torch.float32 else 5e-2), f"outputs differ by {difference}"
            flops = 4 * num_heads * head_size * sum(context - new + i + 1 for i in range(new))
            base, fast = results["torch"][0], results["kernel"][0]
            print(f"| {str(dtype).removeprefix('torch.')} | {context} | {new} | {base:.2f} | {fast:.2f} | "
                  f"{base / fast:.2f}x | {flops / fast / 1e6:.0f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.decode_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--cold", action="store_true", help="the kernel with its K/V in DRAM, against warm")
    parser.add_argument("--prefill", action="store_true", help="prefill attention: SDPA against the prefill kernel")
    args = parser.parse_args(argv)
    kernel = load_kernel()
    if args.prefill:
        if not kernel.prefill_available:
            print("this build has no prefill kernel (no AVX-512): prefill runs SDPA")
            return 0
        return prefill(kernel, args.repeat)
    if args.cold:
        return cold_cache(kernel, args.batch, args.repeat)
    backends = {"torch": TorchAttentionBackend("cpu"), "cpu kernel": CpuAttentionBackend(kernel)}
    print(f"torch threads: {torch.get_num_threads()}; batch {args.batch}; block size {BLOCK_SIZE}; "
          f"median of {args.repeat} calls (plan + decode of one layer)")
    print("| model | dtype | contexts | torch ms | cpu kernel ms | speed-up |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for model, heads in MODELS.items():
        for dtype in (torch.float32, torch.bfloat16):
            rows = [(str(c), [c] * args.batch) for c in map(int, args.contexts.split(","))]
            longest = max(map(int, args.contexts.split(",")))
            mixed_rng = random.Random(7)
            rows.append((f"16-{longest} mixed", [mixed_rng.randint(16, longest) for _ in range(args.batch)]))
            for label, lens in rows:
                step = make_step(lens, heads, dtype, seed=len(lens))
                results = {name: time_decode(b, *step, args.repeat) for name, b in backends.items()}
                difference = (results["torch"][1].float() - results["cpu kernel"][1].float()).abs().max().item()
                assert difference < (1e-4 if dtype == torch.float32 else 3e-2), f"outputs differ by {difference}"
                base, fast = results["torch"][0], results["cpu kernel"][0]
                print(f"| {model} | {str(dtype).removeprefix('torch.')} | {label} | {base:.3f} | {fast:.3f} | "
                      f"{base / fast:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
