"""Values of one config.pbtxt parameter against each other, the engine in-process, alternating.

Each round runs every value once on the same seeded workload (a fresh engine per run, the order
reversed every other round, so a machine's slow stretch does not land on one value), and the table
gives each value's medians: output tok/s, TTFT and ITL p50/p99, the engine's CPU seconds and steps.
Made for the scheduler's knobs, whose best value depends on the CPU (``max_num_batched_tokens``:
perf/RESULTS.md, "The step's token budget on AMX"), and for ``dtype`` itself (``--param dtype --values
float32,bfloat16``: the throughput half of what ``dtype: auto`` is decided on; perf.dtype_choice
gives the agreement half).

    .venv/bin/python -m perf.engine_settings --param max_num_batched_tokens --values 512,1024,2048 \\
        [--repeat 3] [--dtype bfloat16] [--num-requests 64 --input-len uniform:16:512 --output-len uniform:16:256]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.paths import REPO_ROOT
from client.bench.arrivals import ArrivalPattern
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.stats import compute_metrics
from perf import engine_driver
from perf.compare.engine_in_process import run_engine_in_process

COLUMNS = (("tok/s", "output_tok_s", "{:.1f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
           ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"), ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
           ("ITL p99 ms", "itl_p99_ms", "{:.1f}"), ("engine CPU s", "cpu_s", "{:.1f}"), ("steps", "steps", "{:.0f}"))


def round_order(values: list[str], round_index: int) -> list[str]:
    """The values in the order one round runs them: as given, reversed every other round."""
    return list(values) if round_index % 2 == 0 else list(reversed(values))


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Each value's median of every column over its runs."""
    return {value: {key: statistics.median(run[key] for run in rows) for _, key, _ in COLUMNS}
            for value, rows in runs.items() if rows}


def table(param: str, runs: dict[str, list[dict]]) -> str:
    """The markdown table of the medians, one row per value, and the runs per value."""
    lines = [f"| {param} | " + " | ".join(title for title, _, _ in COLUMNS) + " | runs |",
             "| ---: | " + " | ".join("---:" for _ in COLUMNS) + " | ---: |"]
    for value, row in medians(runs).items():
        cells = " | ".join(form.format(row[key]) for _, key, form in COLUMNS)
        lines.append(f"| {value} | {cells} | {len(runs[value])} |")
    return "\n".join(lines)


def measure(model_folder: str, requests, concurrency: int, overrides: dict[str, str], seed: int) -> dict:
    """One run of the engine in-process: the table's columns."""
    records, duration, summary = run_engine_in_process(model_folder, requests, ArrivalPattern("concurrency", concurrency),
                                                       overrides, seed, progress_interval_s=0)
    metrics = compute_metrics(records, duration)
    return {"output_tok_s": metrics.output_token_throughput, "ttft_p50_ms": metrics.ttft_ms.percentiles["p50"],
            "ttft_p99_ms": metrics.ttft_ms.percentiles["p99"], "itl_p50_ms": metrics.itl_ms.percentiles["p50"],
            "itl_p99_ms": metrics.itl_ms.percentiles["p99"], "cpu_s": summary["cpu_s"], "steps": summary["steps"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.engine_settings", description=__doc__.split("\n\n")[0])
    parser.add_argument("--param", required=True, help="a config.pbtxt parameter, e.g. max_num_batched_tokens")
    parser.add_argument("--values", required=True, help="comma-separated values of --param")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default: %(default)s)")
    parser.add_argument("--model", default=str(REPO_ROOT / "model_repository" / "llm"),
                        help="the model folder whose config.pbtxt configures the engine")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="the dtype of every run (with --param dtype, the values instead)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", default="uniform:16:512")
    parser.add_argument("--output-len", default="uniform:16:256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "perf" / "results" / "engine_settings.json")
    args = parser.parse_args(argv)
    values = [v.strip() for v in args.values.split(",") if v.strip()]

    def overrides(value: str) -> dict[str, str]:
        return {"dtype": args.dtype, args.param: value}  # with --param dtype, the value wins

    for value in values:  # a bad value fails here, before any run
        engine_config_from_model_folder(args.model, **overrides(value))
    config = engine_config_from_model_folder(args.model, **overrides(values[0]))
    requests = engine_driver.token_workload(engine_driver.prompt_builder(config), args.num_requests, args.input_len,
                                            args.output_len, args.seed)
    runs: dict[str, list[dict]] = {value: [] for value in values}
    for round_index in range(args.repeat):
        for value in round_order(values, round_index):
            run = measure(args.model, requests, args.num_requests, overrides(value), args.seed)
            runs[value].append(run)
            print(f"round {round_index + 1}/{args.repeat} {args.param}={value}: " +
                  ", ".join(f"{title} {form.format(run[key])}" for title, key, form in COLUMNS), flush=True)
    print(f"\nmedians of {args.repeat} rounds; {args.model}, {args.dtype}, {args.num_requests} requests at once, "
          f"input {args.input_len}, output {args.output_len} (forced)\n")
    print(table(args.param, runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"param": args.param, "runs": runs, "medians": medians(runs), "settings": vars(args),
                                    "git": git_state(), "machine": machine_info(), "when": now_iso()},
                                   indent=2, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
