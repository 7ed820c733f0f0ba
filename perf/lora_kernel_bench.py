"""One projection's LoRA delta: the decode-rows kernel against the per-segment GEMM pair (issue 34).

    .venv/bin/python -m perf.lora_kernel_bench [--rank 16] [--rows 8,64,256] [--repeat 3]

SmolLM2-135M's projection shapes, one adapter of rank ``--rank`` in one slot, ``--rows`` rows: the
CPU kernel ``lora_bgmv`` through LoRASlots (what decode rows take) against torch's
``out.addmm_(x @ A.T, B.T)`` (what prompt rows take), in bfloat16 and float32; microseconds per
call, medians of ``--repeat`` runs of 200 calls. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend.attention.cpu_kernel.build import load_kernel
from backend.lora.adapter import LoRAAdapter
from backend.lora.slots import LoRASlots
from backend.lora.step import LoRAStep

# fused projection -> (in_features, each part's out_features), SmolLM2-135M
SHAPES = {"qkv_proj": (576, (576, 192, 192)), "gate_up_proj": (576, (1536, 1536)), "down_proj": (1536, (576,))}


def one_adapter(projection: str, rank: int, dtype: torch.dtype) -> LoRAAdapter:
    in_features, outs = SHAPES[projection]
    columns = tuple(sum(outs[:i]) for i in range(len(outs) + 1))
    a = torch.randn(len(outs) * rank, in_features)
    b = torch.zeros(sum(outs), len(outs) * rank)
    for part in range(len(outs)):  # block-diagonal, as load_adapter lays PEFT's B out
        b[columns[part]:columns[part + 1], part * rank:(part + 1) * rank] = torch.randn(outs[part], rank)
    return LoRAAdapter("bench", rank, 1.0, "bench", (), {(0, projection): (a.to(dtype), b.to(dtype))},
                       {projection: columns})


def microseconds(step: LoRAStep, key, x: torch.Tensor, out: torch.Tensor, calls: int = 200) -> float:
    for _ in range(10):
        step.apply(key, x, out)
    start = time.perf_counter()
    for _ in range(calls):
        step.apply(key, x, out)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", default="8,64,256")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    kernels = load_kernel()
    torch.manual_seed(0)
    print("| dtype | projection | rows | kernel us | torch GEMM pair us |\n| --- | --- | ---: | ---: | ---: |")
    for dtype in (torch.bfloat16, torch.float32):
        for projection, (in_features, outs) in SHAPES.items():
            adapter = one_adapter(projection, args.rank, dtype)
            key = (0, projection)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, in_features).to(dtype)
                out = torch.zeros(rows, sum(outs)).to(dtype)
                slots = LoRASlots(1, args.rank, dtype, torch.device("cpu"))
                slots.use_kernels(kernels)
                kernel_step = LoRAStep(slots=slots, decode_plan=slots.plan([adapter], [(0, rows)]))
                torch_step = LoRAStep([(adapter, [(0, rows)])])
                runs = [(microseconds(kernel_step, key, x, out), microseconds(torch_step, key, x, out))
                        for _ in range(args.repeat)]
                print(f"| {str(dtype).removeprefix('torch.')} | {projection} | {rows} | "
                      f"{statistics.median(r[0] for r in runs):.1f} | {statistics.median(r[1] for r in runs):.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
