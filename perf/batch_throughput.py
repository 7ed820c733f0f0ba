"""Batch runner against client.bench on the same prompts, and interactive TTFT with a batch run beside it.

    python -m perf.batch_throughput [--url HOST:PORT | --model-repository DIR] [--num-prompts 500]
        [--input-len 128] [--output-len 32] [--sweep 16,32,64] [--interactive-rate 0.5]

1. client.bench's prompts (token-exact, forced output lengths) at each ``--sweep`` concurrency on
   the first ``--sweep-prompts`` of them; the best concurrency then runs all ``--num-prompts``.
2. The same prompts as an OpenAI batch file through ``python -m client.batch`` (its own
   ``--concurrency``, 64 by default: the llm model's max_num_seqs), as a user runs it.
   Throughput of both: output tokens / wall seconds; the ratio batch/bench.
3. Interactive traffic (Poisson, ``--interactive-rate`` requests/s, ``--interactive-requests``, at the
   default priority 0) alone, then while a batch run of the same prompts goes on beside it at
   priority 0 (as fcfs would serve it), then beside one at priority 1 (client.batch's default):
   TTFT p50/p99 of each. A server started here runs the `llm` model with
   ``scheduling_policy: priority`` and without prefix caching (the same prompts run several times:
   a later run would find an earlier one's blocks cached); a copy of model_repository with those two
   parameters changed.

Results: perf/results/batch/<UTC time>/batch.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from client.batch.runner import BatchRunner
from client.bench.arrivals import ArrivalPattern
from client.bench.lengths import parse_length
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.runner import run_workload
from client.bench.stats import compute_metrics
from client.bench.workload import build_workload
from perf.served import add_server_arguments, report_dir, served, write_report


def batch_file(items, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for index, item in enumerate(items):
            body = {"prompt": item.prompt, "max_tokens": item.max_tokens, "ignore_eos": True, "temperature": 0}
            handle.write(json.dumps({"custom_id": f"p{index}", "method": "POST", "url": "/v1/completions",
                                     "body": body}) + "\n")


def bench(url: str, items, pattern: ArrivalPattern, label: str, timeout: float) -> dict:
    with Progress(label, len(items), 10.0) as progress:
        completed, duration = run_workload(url, "llm", items, pattern, timeout_s=timeout, progress=progress)
    metrics = compute_metrics([c.record for c in completed], duration).to_dict()
    return {"label": label, "output_tokens_per_s": metrics["output_token_throughput"], "seconds": duration,
            "errors": metrics["num_errors"], "ttft_ms": metrics["ttft_ms"], "itl_ms": metrics["itl_ms"],
            "output_tokens": metrics["total_output_tokens"]}


def run_batch(url: str, items, work_dir: Path, concurrency: int, timeout: float, name: str, priority: int = 1) -> dict:
    source, output = work_dir / f"{name}.jsonl", work_dir / f"{name}.out.jsonl"
    batch_file(items, source)
    summary = BatchRunner(url, concurrency=concurrency, timeout=timeout, progress_interval=10.0,
                          priority=priority).run(source, output)
    return {"label": f"client.batch concurrency {concurrency}", "output_tokens_per_s": summary.tokens_per_s,
            "seconds": summary.seconds, "errors": summary.failed, "output_tokens": summary.completion_tokens}


# Unless --url names a running server: `llm` scheduling by priority, without prefix caching
# (client.bench and client.batch send the same prompts one after the other, and the second run
# would find the first one's blocks cached).
SERVED_OVERRIDES = {"scheduling_policy": "priority", "enable_prefix_caching": "false"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.batch_throughput", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--sweep-prompts", type=int, default=160, help="prompts per sweep point (default: %(default)s)")
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--sweep", default="16,32,64", help="client.bench concurrencies to find its best")
    parser.add_argument("--batch-concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="bench/batch pairs, alternating order (default: %(default)s)")
    parser.add_argument("--skip-interactive", action="store_true", help="only the throughput comparison")
    parser.add_argument("--interactive-only", action="store_true", help="only the interactive-beside-batch part")
    parser.add_argument("--batch-priorities", default="0,1",
                        help="priorities of the batch runs beside interactive traffic (default: %(default)s)")
    parser.add_argument("--interactive-rate", type=float, default=0.5, help="interactive requests/s (Poisson)")
    parser.add_argument("--interactive-requests", type=int, default=40)
    parser.add_argument("--tokenizer", default="models/smollm2-135m-instruct")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    out = report_dir(args, "batch")
    builder = PromptBuilder(args.tokenizer, None)
    items = build_workload(builder, args.num_prompts, parse_length(args.input_len), parse_length(args.output_len), 0)
    interactive = build_workload(builder, args.interactive_requests, parse_length(args.input_len),
                                 parse_length(args.output_len), 1)
    report: dict = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                 "output_len": args.output_len}, "sweep": [], "throughput": [], "interactive": []}
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as work, served(args, SERVED_OVERRIDES) as server:
        url, work_dir = server.grpc_url, Path(work)
        run_workload(url, "llm", items[:4], ArrivalPattern("concurrency", 4), timeout_s=args.timeout)  # warm-up
        for concurrency in (() if args.interactive_only else (int(c) for c in args.sweep.split(","))):
            row = bench(url, items[: args.sweep_prompts], ArrivalPattern("concurrency", concurrency),
                        f"client.bench concurrency {concurrency} (sweep)", args.timeout)
            report["sweep"].append(dict(row, concurrency=concurrency))
            print(f"sweep: concurrency {concurrency}: {row['output_tokens_per_s']:.1f} tok/s", flush=True)
        best = max(report["sweep"], key=lambda r: r["output_tokens_per_s"])["concurrency"] if report["sweep"] else 0
        ratios = []
        for repeat in range(0 if args.interactive_only else args.repeat):  # alternating which goes first: bench, batch, batch, bench, ...
            pair = []
            for system in (("bench", "batch") if repeat % 2 == 0 else ("batch", "bench")):
                if system == "bench":
                    row = bench(url, items, ArrivalPattern("concurrency", best), f"client.bench concurrency {best}",
                                args.timeout)
                else:
                    row = run_batch(url, items, work_dir, args.batch_concurrency, args.timeout, f"throughput{repeat}")
                report["throughput"].append(dict(row, system=system, repeat=repeat))
                pair.append(row)
            by_system = {r["label"].startswith("client.batch"): r["output_tokens_per_s"] for r in pair}
            ratios.append(by_system[True] / by_system[False])
            print(f"repeat {repeat + 1}/{args.repeat}: batch/bench throughput {ratios[-1]:.3f}", flush=True)
        report["batch_over_bench"] = statistics.median(ratios) if ratios else float("nan")
        report["batch_over_bench_runs"] = ratios

        rate = ArrivalPattern("rate", args.interactive_rate)
        if args.skip_interactive:
            report["batch_beside"] = []
        else:
            _interactive(report, url, items, interactive, rate, work_dir, args)
    write_report(out, "batch", report, to_markdown(report))
    return 0


def _interactive(report: dict, url: str, items, interactive, rate, work_dir: Path, args) -> None:
    """Interactive traffic alone, then beside a batch run at priority 0 and at priority 1."""
    report["interactive"].append(bench(url, interactive, rate, "interactive alone", args.timeout))
    report["batch_beside"] = []
    for priority in (int(p) for p in args.batch_priorities.split(",")):
        beside: dict = {}
        batch_thread = threading.Thread(target=lambda p=priority, b=beside: b.update(
            run_batch(url, items, work_dir, args.batch_concurrency, args.timeout, f"beside{p}", p)))
        batch_thread.start()
        time.sleep(5.0)  # the batch fills the server first
        report["interactive"].append(bench(url, interactive, rate,
                                           f"interactive beside a batch run at priority {priority}", args.timeout))
        batch_thread.join()
        report["batch_beside"].append(dict(beside, priority=priority))


def to_markdown(report: dict) -> str:
    lines = ["| run | output tok/s | seconds | errors |", "| --- | --- | --- | --- |"]
    for row in report["sweep"] + report["throughput"]:
        lines.append(f"| {row['label']} | {row['output_tokens_per_s']:.1f} | {row['seconds']:.1f} | {row['errors']} |")
    runs = ", ".join(f"{r:.3f}" for r in report.get("batch_over_bench_runs", []))
    if runs:
        lines += ["", f"client.batch / client.bench at its best concurrency: {report['batch_over_bench']:.3f} "
                  f"(median of the pairs: {runs})"]
    lines += ["",
              "| interactive traffic | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | errors |",
              "| --- | --- | --- | --- | --- | --- |"]
    for row in report["interactive"]:
        ttft, itl = row["ttft_ms"], row.get("itl_ms") or {"p50": float("nan"), "p99": float("nan")}
        lines.append(f"| {row['label']} | {ttft['p50']:.0f} | {ttft['p99']:.0f} | {itl['p50']:.0f} | {itl['p99']:.0f} "
                     f"| {row['errors']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
