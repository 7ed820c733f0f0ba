"""Offline throughput: our engine (continuous batching) against transformers static batching.

Same model, same seeded mixed workload (default: 64 requests, prompts 16-512 tokens, outputs
16-256 tokens, lengths forced), one system after the other in one run. Static batching takes
requests in arrival order in batches of ``--static-batch-size``, pads them and runs each batch to
its longest member, as request-level batching does; only requested tokens count as output.

    .venv/bin/python -m perf.bench_engine [--num-requests 64] [--static-batch-size 32] [--out-json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def make_workload(num_requests: int, vocab_size: int, seed: int, prompt_range, output_range):
    rng = random.Random(seed)
    return [
        ([1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range) - 1)], rng.randint(*output_range))
        for _ in range(num_requests)
    ]


def run_engine(model_folder: str, workload, overrides: dict[str, str]) -> dict:
    from backend.config import engine_config_from_model_folder
    from backend.engine import LLMEngine
    from backend.request import SamplingParams

    engine = LLMEngine(engine_config_from_model_folder(model_folder, **overrides))
    engine.generate([workload[0][0]], [SamplingParams(max_tokens=4, ignore_eos=True)])  # warm-up
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in workload]
    for index, (prompt, _) in enumerate(workload):
        engine.add_request(f"bench-{index}", prompt_token_ids=prompt, sampling_params=params[index])
    start = time.perf_counter()
    num_tokens, steps, last_report = 0, 0, start
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            num_tokens += len(output.new_token_ids)
        steps += 1
        if time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            print(f"  engine: {num_tokens} tokens, {num_tokens / (last_report - start):.0f} tok/s", flush=True)
    elapsed = time.perf_counter() - start
    return {"output_tokens": num_tokens, "seconds": elapsed, "steps": steps,
            "preemptions": engine.stats().num_preemptions}


def run_static(model_dir: str, workload, batch_size: int, dtype: str = "float32") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    useful = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(workload), batch_size):
            batch = workload[first:first + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):  # left padding
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            longest = max(n for _, n in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
            useful += sum(n for _, n in batch)
            print(f"  static: batch {first // batch_size + 1}/{-(-len(workload) // batch_size)} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return {"output_tokens": useful, "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model-folder", default=str(REPO_ROOT / "model_repository" / "llm"),
                        help="a model folder whose config.pbtxt configures the engine")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--static-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE",
                        help="override a config.pbtxt parameter of the engine (repeatable)")
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args(argv)

    from backend.config import engine_config_from_model_folder

    overrides = dict(item.split("=", 1) for item in args.set)
    config = engine_config_from_model_folder(args.model_folder, **overrides)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(config.model.model_dir).vocab_size
    workload = make_workload(args.num_requests, vocab, args.seed, args.prompt_range, args.output_range)
    print(f"workload: {len(workload)} requests, {sum(len(p) for p, _ in workload)} prompt tokens, "
          f"{sum(n for _, n in workload)} output tokens", flush=True)
    results = {"engine": run_engine(args.model_folder, workload, overrides)}
    if not args.skip_static:
        results["transformers_static"] = run_static(config.model.model_dir, workload, args.static_batch_size)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    print("\n| system | output tokens | seconds | output tok/s |\n| --- | ---: | ---: | ---: |")
    for name, result in results.items():
        result["tokens_per_s"] = result["output_tokens"] / result["seconds"]
        print(f"| {name} | {result['output_tokens']} | {result['seconds']:.1f} | {result['tokens_per_s']:.0f} |")
    if "transformers_static" in results:
        ratio = results["engine"]["tokens_per_s"] / results["transformers_static"]["tokens_per_s"]
        results["ratio_engine_over_static"] = ratio
        print(f"\nengine / transformers static (batch {args.static_batch_size}): {ratio:.2f}x")
    record = {"results": results, "commit": commit, "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
              "config": str(config), "workload": {"num_requests": args.num_requests, "prompt_range": args.prompt_range,
                                                 "output_range": args.output_range, "seed": args.seed}}
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
