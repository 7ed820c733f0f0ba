"""The layer's small ops three ways, side by side: torch eager (what the model runs without the CPU
kernels), torch.compile (inductor, dynamic shapes) of the same code, and our fused kernels
(backend/attention/cpu_kernel/fused_ops.cpp).

Each op at decode and prefill sizes (rows = tokens in the step), SmolLM2-135M's shapes, median of
``--repeat`` calls after a warm-up, the three ways alternating so the machine's noise hits them
alike. torch.compile's first-call compile time is printed too: the model would pay it at load.

    .venv/bin/python -m perf.fused_ops [--rows 1,32,64,512] [--dtype bfloat16] [--repeat 200]

Ops: residual add + RMSNorm (what each decoder layer runs twice), SiLU x up, and the rotary
embedding with the KV-cache write (torch: the rotary of backend/models/rope.py then two
index_copy_ calls).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend.attention.cpu_kernel.build import KernelUnavailable, load_kernel
from backend.models import cpu_fused
from backend.models.llama import RMSNorm
from backend.models.rope import RotaryEmbedding

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_SIZE = 576, 1536, 9, 3, 64  # SmolLM2-135M
BLOCK_SIZE, NUM_BLOCKS = 16, 256


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def make_ops(rows: int, dtype: torch.dtype, kernels):
    """{op: (torch eager fn, our kernel fn)}, each a closure over fresh inputs of `rows` tokens."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=g).to(dtype)
    rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 100000.0}, HEAD_SIZE, dtype,
                             torch.device("cpu"), initial_len=4096)
    q_size, kv_size = HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:rows]
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)

    def norm_torch():
        return norm(x, residual.clone())

    def norm_ours():
        return cpu_fused.rms_norm(kernels, x, norm.weight, norm.eps, residual.clone())

    def silu_torch():
        return torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]

    def silu_ours():
        return cpu_fused.silu_mul(kernels, gate_up)

    def rope_torch():
        qk = rotary(positions, qkv[:, : q_size + kv_size].view(rows, HEADS + KV_HEADS, HEAD_SIZE))
        k = qk[:, HEADS:]
        v = qkv[:, q_size + kv_size :].view(rows, KV_HEADS, HEAD_SIZE)
        key_cache.view(-1, KV_HEADS, HEAD_SIZE).index_copy_(0, slots, k)
        value_cache.view(-1, KV_HEADS, HEAD_SIZE).index_copy_(0, slots, v)
        return qk[:, :HEADS]

    def rope_ours():
        return cpu_fused.rope_cache(kernels, qkv, positions, rotary.cos_sin_cache, key_cache, value_cache, slots,
                                    HEADS)

    return {"residual add + RMSNorm": (norm_torch, norm_ours), "SiLU x up": (silu_torch, silu_ours),
            "rotary + KV-cache write": (rope_torch, rope_ours)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.fused_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,64,512", help="tokens per step to time (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = parser.parse_args(argv)
    try:
        kernels = load_kernel()
    except KernelUnavailable as exc:
        print(f"the CPU kernels are unavailable here: {exc}")
        return 1
    dtype = getattr(torch, args.dtype)
    first_call: dict[str, float] = {}  # the slowest first call of each op's compiled function
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, SmolLM2-135M shapes; "
          f"median of {args.repeat} calls, microseconds")
    print("| op | rows | torch eager | torch.compile | our kernel | ours vs eager | ours vs compile |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            for name, (eager, ours) in make_ops(rows, dtype, kernels).items():
                fns = {"eager": eager, "ours": ours}
                if not args.no_compile:
                    compiled_fn = torch.compile(eager, dynamic=True)
                    start = time.perf_counter()
                    compiled_fn()  # compiles (the first time) or takes dynamo's cache
                    first_call[name] = max(first_call.get(name, 0.0), time.perf_counter() - start)
                    fns["compile"] = compiled_fn
                for fn in fns.values():
                    fn()
                times: dict[str, list[float]] = {key: [] for key in fns}
                for _ in range(5):  # alternate the ways, 5 rounds
                    for key, fn in fns.items():
                        times[key].append(median_us(fn, max(1, args.repeat // 5)))
                us = {key: statistics.median(values) for key, values in times.items()}
                comp = us.get("compile")
                compile_cell = "-" if comp is None else f"{comp:.1f}"
                versus_compile = "-" if comp is None else f"{comp / us['ours']:.2f}x"
                print(f"| {name} | {rows} | {us['eager']:.1f} | {compile_cell} | {us['ours']:.1f} | "
                      f"{us['eager'] / us['ours']:.2f}x | {versus_compile} |", flush=True)
    for name, seconds in first_call.items():
        print(f"torch.compile of {name}: {seconds:.1f} s at its slowest first call (compile or recompile)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
