"""What JSON-schema constraints cost a served model: the same workload with and without them, side by side.

    python -m perf.structured_output [--url HOST:PORT | --model-repository DIR] [--concurrency 1,16]
                                     [--num-requests 32] [--repeat 3]

The workload: chat prompts asking for JSON of the 45 schemas in tests/unit/structured_output_schemas.py
(the real default model). A calibration pass sends each prompt constrained to its schema and notes
how many tokens it wrote; then, per concurrency and repeat, the two modes alternate over the same
prompts: ``json`` (constrained, ending where the grammar ends) and ``free`` (unconstrained,
``ignore_eos`` and ``max_tokens`` set to that very count), so both modes generate the same tokens
per prompt and differ only in the masks. Closed loop: C clients, each on its own gRPC stream
(client.bench's load generator).

Reported per concurrency: output tokens/s and inter-token latency p50/p99 of each mode (medians over
the repeats), the throughput ratio json/free, and the server's compile times from /metrics; plus
compile times in this process on the same tokenizer (first compile of each schema, and a cached one).
Results: perf/results/structured_output/<UTC time>/{results.json,results.md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from transformers import AutoConfig

from backend.engine.tokenizer import load_tokenizer
from backend.protocol.structured_output import parse_structured_outputs
from backend.structured_output.compiler import GrammarCompiler
from client.bench.arrivals import ArrivalPattern
from client.bench.completed import CompletedRequest
from client.bench.runner import run_workload
from client.bench.stats import compute_metrics, percentile
from client.bench.workload import WorkItem
from perf.compare.histogram import model_values
from perf.served import add_server_arguments, report_dir, served, write_report
from tests.unit.structured_output_schemas import SCHEMAS

MAX_TOKENS = 192


def prompts() -> list[tuple[list[dict], dict]]:
    return [([{"role": "user", "content": f"Describe {what} as a JSON object following this JSON schema: "
                                          f"{json.dumps(schema)}"}], schema) for what, schema in SCHEMAS]


def chat_item(messages: list[dict], max_tokens: int, **inputs) -> WorkItem:
    return WorkItem(None, 0, max_tokens, inputs={"messages": messages, **inputs})


def send(url: str, items: list[WorkItem], concurrency: int, timeout: float) -> tuple[list[CompletedRequest], float]:
    return run_workload(url, "llm", items, ArrivalPattern("concurrency", concurrency), timeout_s=timeout)


def run_load(url: str, items: list[WorkItem], concurrency: int, timeout: float) -> dict:
    """Sends ``items`` from ``concurrency`` closed-loop clients; throughput and pooled ITL."""
    completed, elapsed = send(url, items, concurrency, timeout)
    metrics = compute_metrics([c.record for c in completed], elapsed).to_dict()
    errors = [c.record.error for c in completed if c.record.error]
    return {"requests": metrics["num_completed"], "errors": errors[:3], "num_errors": len(errors),
            "output_tokens": metrics["total_output_tokens"], "seconds": elapsed,
            "tokens_per_s": metrics["output_token_throughput"],
            "itl_p50_ms": metrics["itl_ms"].get("p50"), "itl_p99_ms": metrics["itl_ms"].get("p99"),
            "finished_stop": sum(c.finish_reason == "stop" for c in completed if not c.record.error)}


COMPILE_SERIES = ("llm_structured_output_compile_seconds_sum", "llm_structured_output_compile_seconds_count",
                  "llm_structured_output_cache_hits_total", "llm_structured_output_compiles_total")


def server_compile_metrics(http_metrics_url: str) -> dict:
    return model_values(http_metrics_url, COMPILE_SERIES)


def local_compile_times(tokenizer_dir: str) -> dict:
    """First and cached compile of every schema, in this process (the same GrammarCompiler the engine
    uses, on the model's vocabulary: ``tokenizer_dir`` is the model's folder)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, AutoConfig.from_pretrained(tokenizer_dir).vocab_size, [tokenizer.eos_token_id])
    compiler.wait_started(120)  # compile times, not the worker's start
    first, cached = [], []
    for _, schema in SCHEMAS:
        spec = parse_structured_outputs({"json": schema})
        for times in (first, cached):
            start = time.perf_counter()
            compiler.compile(spec).result()
            times.append(time.perf_counter() - start)
    compiler.close()
    ms = lambda values, q: percentile(values, q) * 1e3  # noqa: E731
    return {"first_p50_ms": ms(first, 50), "first_max_ms": ms(first, 100), "cached_p50_ms": ms(cached, 50),
            "cached_max_ms": ms(cached, 100), "schemas": len(first)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.structured_output", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--concurrency", default="1,16", help="closed-loop clients, a list (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per mode and run (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs per mode (default: %(default)s)")
    parser.add_argument("--tokenizer", default="models/smollm2-135m-instruct")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    out = report_dir(args, "structured_output")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    chats = prompts()
    print("compile times in this process ...", flush=True)
    compile_local = local_compile_times(args.tokenizer)
    print(json.dumps(compile_local), flush=True)
    report: dict = {"local_compile": compile_local, "runs": []}
    with served(args) as server:
        metrics_url = (server.server.metrics_url if server.server is not None
                       else f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics")
        # Calibration: each prompt constrained once, to learn its output length (and warm the caches).
        print(f"calibrating {len(chats)} prompts ...", flush=True)
        calibration, _ = send(server.grpc_url, [chat_item(messages, MAX_TOKENS, stream=False, sampling_parameters={
            "structured_outputs": {"json": schema}}) for messages, schema in chats], 1, args.timeout)
        lengths = [max(1, c.record.num_output_tokens) for c in calibration]
        report["server_compile_after_calibration"] = server_compile_metrics(metrics_url)
        order = [i % len(chats) for i in range(args.num_requests)]
        modes = {
            "json": [chat_item(chats[i][0], MAX_TOKENS, sampling_parameters={"structured_outputs": {"json": chats[i][1]}})
                     for i in order],
            "free": [chat_item(chats[i][0], lengths[i], ignore_eos=True) for i in order],
        }
        for concurrency in concurrencies:
            for repeat in range(args.repeat):
                for mode in (("json", "free") if repeat % 2 == 0 else ("free", "json")):
                    row = run_load(server.grpc_url, modes[mode], concurrency, args.timeout)
                    row.update(mode=mode, concurrency=concurrency, repeat=repeat)
                    report["runs"].append(row)
                    print(f"c={concurrency} repeat {repeat + 1}/{args.repeat} {mode:>4}: {row['tokens_per_s']:.1f} tok/s, "
                          f"ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms, "
                          f"{row['num_errors']} errors", flush=True)
        report["server_compile_end"] = server_compile_metrics(metrics_url)
    report["summary"] = summarize(report["runs"], concurrencies)
    write_report(out, "results", report, to_markdown(report))
    return 0 if all(r["num_errors"] == 0 for r in report["runs"]) else 1


def summarize(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    rows = []
    for concurrency in concurrencies:
        row = {"concurrency": concurrency}
        for mode in ("free", "json"):
            mine = [r for r in runs if r["concurrency"] == concurrency and r["mode"] == mode]
            for key in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms"):
                row[f"{mode}_{key}"] = statistics.median(r[key] for r in mine)
        ratios = [j["tokens_per_s"] / f["tokens_per_s"] for j in runs for f in runs
                  if j["concurrency"] == f["concurrency"] == concurrency and j["repeat"] == f["repeat"]
                  and j["mode"] == "json" and f["mode"] == "free"]
        row["json_over_free"] = statistics.median(ratios)
        rows.append(row)
    return rows


def to_markdown(report: dict) -> str:
    lines = ["| concurrency | free tok/s | json tok/s | json/free | free ITL p50 / p99 (ms) | json ITL p50 / p99 (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in report["summary"]:
        lines.append(f"| {row['concurrency']} | {row['free_tokens_per_s']:.1f} | {row['json_tokens_per_s']:.1f} | "
                     f"{row['json_over_free']:.3f} | {row['free_itl_p50_ms']:.1f} / {row['free_itl_p99_ms']:.1f} | "
                     f"{row['json_itl_p50_ms']:.1f} / {row['json_itl_p99_ms']:.1f} |")
    local = report["local_compile"]
    lines.append("")
    lines.append(f"Compile ({local['schemas']} schemas, this process): first p50 {local['first_p50_ms']:.1f} ms, "
                 f"max {local['first_max_ms']:.1f} ms; cached p50 {local['cached_p50_ms']:.3f} ms, "
                 f"max {local['cached_max_ms']:.3f} ms.")
    server = report.get("server_compile_end", {})
    count = server.get("llm_structured_output_compile_seconds_count")
    if count:
        lines.append(f"Server: {count:.0f} compiles, mean {server['llm_structured_output_compile_seconds_sum'] / count * 1e3:.1f} ms, "
                     f"{server.get('llm_structured_output_cache_hits_total', 0):.0f} cache hits.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
