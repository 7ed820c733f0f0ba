"""One sparse MLP layer's experts: our CPU kernel against our torch path and vLLM's fused MoE (issue 35).

    .venv/bin/python -m perf.moe_kernel_bench [--tokens 1,8,32,128,512,2048] [--repeat 5] [--no-vllm]

The shapes of ``models/qwen3-moe-smol`` (8 experts of 768 on a hidden size of 576, top 2): our
``SparseMoeBlock`` with the kernel (``moe_experts``, backend/models/moe_cpu.py) and without it (a
oneDNN GEMM pair per expert with work), and vLLM CPU 0.32's ``cpu_fused_moe`` on weights prepacked
by ``cpu_prepack_moe_weight`` (its ``vec`` kernel for unquantized experts), run in vLLM's own
environment (``make peers``) as a subprocess. Thirty layers of weights, called in turn, so every
call reads its weights from memory as a real step does. Ours includes the routing (router GEMM,
softmax, top-k); vLLM's is handed the routing. Microseconds per layer, median of ``--repeat`` passes,
in float32 and bfloat16. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

EXPERTS, HIDDEN, INTER, TOP_K, LAYERS = 8, 576, 768, 2, 30
DTYPES = ("float32", "bfloat16")


def timed(call, repeat: int) -> float:
    """Median microseconds per layer of ``call`` (which runs all layers once)."""
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) / LAYERS * 1e6)
    return statistics.median(times)


def ours(tokens: list[int], repeat: int) -> dict:
    from backend.attention.cpu_kernel.build import load_kernel  # noqa: PLC0415 (process: --as-vllm runs this module in vLLM's venv (.peers/vllm), which loads none of our backend)
    from backend.models.family import MoeSpec  # noqa: PLC0415 (process: --as-vllm runs this module in vLLM's venv (.peers/vllm), which loads none of our backend)
    from backend.models.moe import SparseMoeBlock  # noqa: PLC0415 (process: --as-vllm runs this module in vLLM's venv (.peers/vllm), which loads none of our backend)

    kernels = load_kernel()
    results = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        blocks = []
        for _ in range(LAYERS):
            block = SparseMoeBlock(HIDDEN, MoeSpec(EXPERTS, TOP_K, INTER, True, True), "silu")
            with torch.no_grad():
                for parameter in block.parameters():
                    parameter.normal_(0, 0.02)
            block = block.to(dtype)
            block.prepack()
            blocks.append(block)
        torch_path = {}
        with torch.inference_mode():
            for count in tokens:
                x = torch.randn(count, HIDDEN).to(dtype)
                torch_path[count] = timed(lambda x=x, blocks=blocks: [block(x) for block in blocks], repeat)
            for block in blocks:
                block.use_kernels(kernels)
                block.cpu_experts.max_tokens = None  # the kernel at every size, to show where it stops winning
            for count in tokens:
                x = torch.randn(count, HIDDEN).to(dtype)
                results[(name, count)] = (timed(lambda x=x, blocks=blocks: [block(x) for block in blocks], repeat), torch_path[count])
    return {f"{name}/{count}": value for (name, count), value in results.items()}


def vllm(tokens: list[int], repeat: int) -> dict:  # runs inside vLLM's environment
    import vllm._custom_ops as ops  # noqa: PLC0415 (optional: vllm's _custom_ops, the peer in .peers/vllm, whose venv runs this with --as-vllm)

    results = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        w13 = [ops.cpu_prepack_moe_weight((torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.02).to(dtype), "vec")
               for _ in range(LAYERS)]
        w2 = [ops.cpu_prepack_moe_weight((torch.randn(EXPERTS, HIDDEN, INTER) * 0.02).to(dtype), "vec")
              for _ in range(LAYERS)]
        for count in tokens:
            x = torch.randn(count, HIDDEN).to(dtype)
            weights, ids = torch.topk(torch.softmax(torch.randn(count, EXPERTS), -1), TOP_K, -1)
            weights, ids = weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)
            out = torch.empty_like(x)

            def call(x=x, weights=weights, ids=ids, out=out, w13=w13, w2=w2):
                for layer in range(LAYERS):
                    ops.cpu_fused_moe(out, x, w13[layer], w2[layer], None, None, weights, ids, "silu", "vec")

            results[f"{name}/{count}"] = timed(call, repeat)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,128,512,2048")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--as-vllm", action="store_true", help=argparse.SUPPRESS)  # the subprocess's part
    args = parser.parse_args()
    tokens = [int(value) for value in args.tokens.split(",")]
    if args.as_vllm:
        print(json.dumps(vllm(tokens, args.repeat)))
        return 0
    vllm_times = {}
    if not args.no_vllm:
        from perf.compare.vllm_server import offline_environment, vllm_python  # noqa: PLC0415 (process: --as-vllm runs this module in vLLM's venv (.peers/vllm), which loads none of our backend)

        python = vllm_python()


        done = subprocess.run([str(python), "-m", "perf.moe_kernel_bench", "--as-vllm", "--tokens", args.tokens,
                               "--repeat", str(args.repeat)], capture_output=True, text=True, check=True,
                              env={**os.environ, **offline_environment(python)})
        vllm_times = json.loads(done.stdout.strip().splitlines()[-1])
    times = ours(tokens, args.repeat)
    print(f"One layer's experts ({EXPERTS} x {INTER} on {HIDDEN}, top {TOP_K}), {LAYERS} layers in turn, "
          f"torch threads {torch.get_num_threads()}; microseconds per layer, median of {args.repeat}\n")
    print("| dtype | tokens | kernel | torch path | vLLM cpu_fused_moe | kernel / torch | kernel / vLLM |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key, (kernel, torch_path) in times.items():
        name, count = key.split("/")
        peer = vllm_times.get(key)
        print(f"| {name} | {count} | {kernel:.0f} | {torch_path:.0f} | {'-' if peer is None else f'{peer:.0f}'} | "
              f"{kernel / torch_path:.2f} | {'-' if peer is None else f'{kernel / peer:.2f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
