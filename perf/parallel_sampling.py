"""Parallel sampling: n = 4 samples of one request against 4 separate requests with the same
prompt, at the same KV pool size (issue 16).

Engine level, the `llm` model's config (``--model-folder`` picks another), prefix caching off (so
the separate requests share nothing), client.bench's prompts on the model's tokenizer: both workloads generate the same number of tokens from the same prompts with the same
seeds (sample i of a request with seed s is the request alone with seed s + i, so the tokens are
equal, which the run checks), alternating, ``--repeat`` times. Reported: wall time, output
tokens/s, peak KV blocks in use, prefill tokens computed, preemptions.

    python -m perf.parallel_sampling [--num-prompts 4] [--prompt-tokens 512] [--output-tokens 64] [--num-kv-blocks 256]

``--beam`` measures beam search instead: ``beam_width`` 4 with its forks sharing blocks (copy-on-write)
against forks that copy every block (``KVCacheManager.share_forks = False``), in a pool large
enough for both: peak KV blocks in use and output tokens/s, and the same beams from both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from perf import engine_driver
from perf.served import RESULTS_DIR, write_report

N = 4


def requests(prompts: list[list[int]], output_tokens: int, shared: bool, beam: bool) -> list:
    """The workload's requests: per prompt one with N samples (or N beams), or N of one sample each."""
    if beam:
        return [(prompt, SamplingParams(max_tokens=output_tokens, beam_width=N, n=1)) for prompt in prompts]
    if shared:
        return [(prompt, SamplingParams(max_tokens=output_tokens, temperature=0.8, seed=1000 * index, n=N,
                                        ignore_eos=True)) for index, prompt in enumerate(prompts)]
    return [(prompt, SamplingParams(max_tokens=output_tokens, temperature=0.8, seed=1000 * index + i, ignore_eos=True))
            for index, prompt in enumerate(prompts) for i in range(N)]


def run(engine: LLMEngine, work: list, label: str) -> dict:
    """All requests at once; returns the measurements and every sample's tokens (in request order)."""
    usable = engine.num_kv_blocks - 1
    peak, prefill = 0, 0

    def on_step(step) -> None:
        nonlocal peak, prefill
        prefill += step.stats.num_prefill_tokens
        peak = max(peak, usable - engine.kv_cache_manager.num_free_blocks)

    preemptions = engine.stats().num_preemptions
    done = engine_driver.run(engine, work, on_step=on_step, label=label)
    return {"seconds": done.duration_s, "tokens_per_second": done.driver.num_tokens / done.duration_s,
            "peak_blocks": peak, "prefill_tokens": prefill,
            "preemptions": engine.stats().num_preemptions - preemptions,
            "tokens": [tokens for record in done.records for tokens in record.sample_token_ids]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_driver.add_model_folder_argument(parser)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype parameter (float32: token-exact checks)")
    parser.add_argument("--beam", action="store_true", help="beam search: shared forks against copied ones")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    engine = LLMEngine(engine_config_from_model_folder(
        args.model_folder, enable_prefix_caching="false", num_kv_blocks=str(args.num_kv_blocks), dtype=args.dtype))
    builder = engine_driver.prompt_builder(engine.config)
    prompts = [prompt for prompt, _ in engine_driver.token_workload(
        builder, args.num_prompts, str(args.prompt_tokens), "1", 16)]
    print(f"{args.num_prompts} prompts of {args.prompt_tokens} tokens, {N} samples each, {args.output_tokens} output "
          f"tokens; pool {args.num_kv_blocks} blocks of {engine.model_runner.block_size}; dtype {engine.model_runner.dtype}",
          flush=True)
    names = (("beam_width=4, shared forks", True), ("beam_width=4, forks copy their blocks", False)) if args.beam else \
        (("n=4 (shared blocks)", True), ("4 separate requests", False))
    results: dict[str, list[dict]] = {name: [] for name, _ in names}
    for round_ in range(args.repeat):
        for name, shared in names:
            if args.beam:
                engine.kv_cache_manager.share_forks = shared
            result = run(engine, requests(prompts, args.output_tokens, shared, args.beam), f"{round_}-{shared}")
            engine.kv_cache_manager.share_forks = True
            results[name].append(result)
            print(f"round {round_ + 1}/{args.repeat} {name}: {result['seconds']:.1f} s, "
                  f"{result['tokens_per_second']:.1f} tok/s, peak {result['peak_blocks']} blocks, "
                  f"{result['preemptions']} preemptions", flush=True)
    baseline_name, shared_name = names[1][0], names[0][0]
    same = all(r["tokens"] == results[baseline_name][0]["tokens"] for rows in results.values() for r in rows)
    summary = {name: {key: statistics.median(r[key] for r in rows)
                      for key in ("seconds", "tokens_per_second", "peak_blocks", "prefill_tokens", "preemptions")}
               for name, rows in results.items()}
    shared, separate = summary[shared_name], summary[baseline_name]
    what = "Beam search, beam_width" if args.beam else "Parallel sampling:"
    lines = [
        f"{what} {args.num_prompts} prompts x {N} {'beams' if args.beam else 'samples'}, {args.prompt_tokens}-token prompts, "
        f"{args.output_tokens} output tokens, prefix caching off, pool {args.num_kv_blocks} blocks "
        f"(engine level, {Path(engine.config.model.model_dir).name}, {engine.model_runner.dtype}; medians of {args.repeat})",
        "",
        "| workload | wall s | output tok/s | peak KV blocks | prefill tokens | preemptions |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {name} | {s['seconds']:.1f} | {s['tokens_per_second']:.1f} | {s['peak_blocks']:.0f} | "
          f"{s['prefill_tokens']:.0f} | {s['preemptions']:.0f} |" for name, s in summary.items()],
        "",
        f"{shared_name} / {baseline_name}: throughput {shared['tokens_per_second'] / separate['tokens_per_second']:.2f}x, "
        f"peak KV blocks {shared['peak_blocks'] / separate['peak_blocks']:.2f}x; same tokens: {same}",
        "",
        f"command: python -m perf.parallel_sampling {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
    ]
    document = {"args": vars(args), "summary": summary, "same_tokens": same,
                "runs": {k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in results.items()}}
    out = Path(args.out_dir) if args.out_dir else RESULTS_DIR / "parallel_sampling" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    write_report(out, "parallel_sampling", document, "\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
