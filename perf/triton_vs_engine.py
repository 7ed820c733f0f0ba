"""The Triton path against our engine in-process: same workload, same engine settings, one run.

In-process, then through tritonserver (the `llm` model, gRPC streaming via client.bench), then
in-process again, so drift on a shared machine hits both sides; the ratio uses the mean of the two
in-process runs. All requests are offered at once (concurrency = number of requests), prompts and
outputs of fixed length (outputs forced with ignore_eos).

    .venv/bin/python -m perf.triton_vs_engine [--num-requests 64] [--input-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_in_process(num_requests: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens per second of LLMEngine.generate() over the whole batch."""
    from backend.config import engine_config_from_model_folder
    from backend.engine import LLMEngine
    from backend.request import SamplingParams

    engine = LLMEngine(engine_config_from_model_folder(str(REPO_ROOT / "model_repository" / "llm")))
    rng = random.Random(seed)
    vocab = engine.vocab_size
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(input_len - 1)] for _ in range(num_requests)]
    engine.generate([prompts[0][:8]], [SamplingParams(max_tokens=2, ignore_eos=True)])  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, [SamplingParams(max_tokens=output_len, ignore_eos=True)] * num_requests)
    elapsed = time.perf_counter() - start
    return sum(len(r.output_token_ids) for r in results) / elapsed


def run_triton(num_requests: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens per second measured by client.bench against a server started for it."""
    from perf.run_client_bench import main as run_client_bench

    out = Path(tempfile.mkdtemp(prefix="triton_vs_engine-")) / "bench.json"
    code = run_client_bench(["--", "--concurrency", str(num_requests), "--num-requests", str(num_requests),
                             "--input-len", str(input_len), "--output-len", str(output_len),
                             "--seed", str(seed), "--out-json", str(out), "--progress-interval", "15"])
    if code != 0:
        raise SystemExit(f"client.bench failed with exit code {code}")
    return json.loads(out.read_text())["runs"][0]["metrics"]["output_token_throughput"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.triton_vs_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = (args.num_requests, args.input_len, args.output_len, args.seed)
    print("in-process engine (1/2)...", flush=True)
    first = run_in_process(*shape)
    print(f"  {first:.1f} output tok/s\nTriton llm over gRPC streams...", flush=True)
    triton = run_triton(*shape)
    print(f"  {triton:.1f} output tok/s\nin-process engine (2/2)...", flush=True)
    second = run_in_process(*shape)
    print(f"  {second:.1f} output tok/s", flush=True)
    in_process = (first + second) / 2
    print("\n| system | output tok/s |\n| --- | ---: |")
    print(f"| engine in-process (run 1) | {first:.1f} |\n| Triton `llm` (gRPC streaming) | {triton:.1f} |")
    print(f"| engine in-process (run 2) | {second:.1f} |")
    print(f"\nTriton / in-process: {triton / in_process:.2f}x (target: at least 0.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
