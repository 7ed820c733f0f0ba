"""Command line of the load generator: parse, build the workload, run each sweep point, report.

    python -m client.bench --concurrency 1,8,32 --num-requests 64 --input-len 128 --output-len 64 \\
        --out-json perf/results/bench.json --out-md perf/results/bench.md --out-plot perf/results/bench.png

Load: ``--concurrency`` (closed loop), ``--request-rate`` (Poisson, seeded) or ``--burst-size`` with
``--burst-interval``; a comma-separated list is a sweep, one run per value. Output lengths are
forced (max_tokens with ignore_eos=true). Each run gets its own prompts (seed + run index) so one
run's prompts do not hit the prefix cache filled by another; rerunning with the same seed on the
same server does hit it: change --seed or restart the server to compare cold runs.
Exit status: 0 when every request succeeded, 1 when some failed, 2 when the run could not start.
"""

from __future__ import annotations

import argparse
import sys

from client.bench.arrivals import ArrivalPattern, parse_sweep
from client.bench.completed import CompletedRequest, count_length_mismatches
from client.bench.lengths import parse_length
from client.bench.metadata import git_state, machine_info, now_iso, server_model_config
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder, PromptError
from client.bench.report import write_json, write_markdown, write_plots
from client.bench.runner import API_OPENAI, API_TRITON, run_workload
from client.bench.stats import SloTargets, compute_metrics
from client.bench.tenants import Tenants, add_tenant_arguments, build_tenant_workload, prefix_reuse
from client.bench.workload import RUN_SEED_STRIDE, SharedPrefix, WorkItem, build_workload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--url", default="localhost:8001",
                        help="Triton gRPC address, or http://host:port with --api openai (default: %(default)s)")
    parser.add_argument("--api", choices=(API_TRITON, API_OPENAI), default=API_TRITON,
                        help="triton: the llm model over gRPC streams; openai: /v1/completions streaming of an "
                             "OpenAI-compatible server such as vLLM, to compare stacks (default: %(default)s)")
    parser.add_argument("--model", default="llm", help="model name (default: %(default)s)")
    parser.add_argument("--tokenizer", default="models/smollm2-135m-instruct", help="folder with tokenizer.json (default: %(default)s)")
    parser.add_argument("--corpus", default=None, help="text the prompts are cut from (default: data/demo_corpus.txt)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="users, closed loop; a list sweeps (e.g. 1,8,32; default 1)")
    load.add_argument("--request-rate", help="requests/s, Poisson arrivals; a list sweeps (e.g. 1,2,4)")
    load.add_argument("--burst-size", help="requests sent at once every --burst-interval s; a list sweeps")
    parser.add_argument("--burst-interval", type=float, default=1.0, help="seconds between bursts (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per run (default: %(default)s)")
    parser.add_argument("--input-len", default="128",
                        help="prompt tokens (suffix tokens with --num-prefixes): N, uniform:MIN:MAX, "
                             "lognormal:MEDIAN:SIGMA:MIN:MAX or chat[:MEDIAN] (default: %(default)s)")
    parser.add_argument("--output-len", default="64", help="output tokens, same forms (default: %(default)s)")
    parser.add_argument("--num-prefixes", type=int, default=0, help="shared system prompts (0: none)")
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared system prompt")
    add_tenant_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="clip prompt + output to this (default: the server's max_model_len parameter)")
    parser.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts and arrivals (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests before the runs (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="open-loop cap on requests in flight (streams) (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default: %(default)s)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput target on TTFT (ms)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput target on TPOT (ms)")
    parser.add_argument("--percentiles", default="50,90,99", help="latency percentiles (default: %(default)s)")
    parser.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines (0: off)")
    parser.add_argument("--out-json", default=None, help="write every result here")
    parser.add_argument("--out-md", default=None, help="write a markdown table here")
    parser.add_argument("--out-plot", default=None, help="write latency-vs-throughput plots (PNG) here")
    return parser


def sweep_from_args(args: argparse.Namespace) -> list[ArrivalPattern]:
    if args.request_rate:
        return parse_sweep(args.request_rate, "rate")
    if args.burst_size:
        return parse_sweep(args.burst_size, "burst", args.burst_interval)
    return parse_sweep(args.concurrency or "1", "concurrency")


def request_rows(completed: list[CompletedRequest], run_start: float) -> list[dict]:
    rows = []
    for item in completed:
        r = item.record
        rows.append({
            "start_s": r.start_time - run_start,
            "input_tokens": r.num_input_tokens, "expected_input_tokens": item.expected_input_tokens,
            "output_tokens": r.num_output_tokens, "expected_output_tokens": item.expected_output_tokens,
            "ttft_ms": None if r.ttft is None else r.ttft * 1000,
            "tpot_ms": None if r.tpot is None else r.tpot * 1000,
            "e2e_ms": r.e2e * 1000, "num_token_responses": len(r.token_times),
            "finish_reason": item.finish_reason, "error": r.error,
        })
    return rows


class BenchError(Exception):
    """A bad argument or a server that cannot be measured: printed as an error, exit status 2."""


class Bench:
    """One client.bench invocation: the sweep, its workloads (one per run), the runs' results."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        try:
            self.sweep = sweep_from_args(args)
            self.builder = PromptBuilder(args.tokenizer, args.corpus)
            self.input_lengths = parse_length(args.input_len, minimum=1)
            self.output_lengths = parse_length(args.output_len, minimum=1)
            self.percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
        except (ValueError, PromptError) as exc:
            raise BenchError(str(exc)) from None
        self.server_config = server_model_config(args.url, args.model) if args.api == API_TRITON else {"parameters": {}}
        if "error" in self.server_config:
            raise BenchError(f"cannot read the config of model {args.model!r} at {args.url}: "
                             f"{self.server_config['error']}")
        self.max_model_len = args.max_model_len or int(self.server_config["parameters"].get("max_model_len") or 0) or None
        self.shared_prefix = SharedPrefix(args.num_prefixes, args.prefix_len) if args.num_prefixes > 0 else None
        if self.shared_prefix and args.prefix_len <= self.builder.num_special_tokens:
            raise BenchError("--prefix-len must exceed the tokenizer's special tokens")
        self.slo = SloTargets(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
                              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000)
        self.tenants = Tenants.from_args(args) if args.tenants > 0 else None
        self.runs: list[dict] = []

    def workload(self, run_index: int, count: int) -> list[WorkItem]:
        return build_workload(self.builder, count, self.input_lengths, self.output_lengths,
                              self.args.seed + run_index * RUN_SEED_STRIDE, self.shared_prefix, self.max_model_len)

    def run_items(self, run_index: int) -> list[WorkItem]:
        if self.tenants is None:
            return self.workload(run_index, self.args.num_requests)
        return build_tenant_workload(self.builder, self.tenants, self.output_lengths,
                                     self.args.seed + run_index * RUN_SEED_STRIDE, self.max_model_len)

    def prepare(self) -> tuple[list[list[WorkItem]], list[WorkItem]]:
        """Every run's prompts and the warm-up's, built before anything is sent."""
        args = self.args
        try:
            count = args.num_requests if self.tenants is None else self.tenants.num_requests
            print(f"building prompts: {len(self.sweep)} run(s) x {count} requests", flush=True)
            workloads = [self.run_items(i) for i in range(len(self.sweep))]
            warmup_items = self.workload(len(self.sweep), args.warmup) if args.warmup > 0 else []
        except PromptError as exc:
            raise BenchError(str(exc)) from None
        return workloads, warmup_items

    def warm_up(self, items: list[WorkItem]) -> None:
        completed, _ = run_workload(self.args.url, self.args.model, items, ArrivalPattern("concurrency", 1),
                                    timeout_s=self.args.timeout, api=self.args.api)
        failures = [c.record.error for c in completed if c.record.error]
        if failures:
            raise BenchError(f"warm-up request failed: {failures[0]}")

    def measure(self, run_index: int, pattern: ArrivalPattern, items: list[WorkItem]) -> None:
        args = self.args
        with Progress(pattern.label, len(items), args.progress_interval) as progress:
            completed, duration = run_workload(
                args.url, args.model, items, pattern, seed=args.seed + run_index, timeout_s=args.timeout,
                max_concurrency=args.max_concurrency, progress=progress, api=args.api,
            )
        records = [c.record for c in completed]
        metrics = compute_metrics(records, duration, self.slo, self.percentiles)
        reuse = prefix_reuse(self.builder, list(items)) if self.tenants is not None else None
        run_start = min((r.start_time for r in records), default=0.0)
        mismatched = count_length_mismatches(completed)
        if mismatched:
            print(f"warning: {mismatched} requests had token counts other than requested", file=sys.stderr)
        self.runs.append({"arrival": pattern.to_dict(), "metrics": metrics.to_dict(),
                          "num_mismatched_lengths": mismatched, "prefix_reuse": reuse,
                          "requests": request_rows(completed, run_start)})
        if reuse is not None:
            print(f"prefix reuse: {reuse['ideal_hit_rate']:.1%} of {reuse['prompt_tokens']} prompt tokens would hit "
                  "one replica with an unbounded cache", flush=True)
        print(summary_line(pattern.label, metrics.to_dict()), flush=True)

    def document(self) -> dict:
        args, shared_prefix = self.args, self.shared_prefix
        return {
            "tool": "client.bench", "created": now_iso(), "url": args.url, "api": args.api, "model": args.model,
            "git": git_state(), "machine": machine_info(), "server_model_config": self.server_config,
            "workload": {
                "num_requests": args.num_requests, "input_len": self.input_lengths.to_dict(),
                "output_len": self.output_lengths.to_dict(), "tokenizer": args.tokenizer, "corpus": args.corpus,
                "shared_prefix": None if shared_prefix is None else {"num_prefixes": shared_prefix.num_prefixes,
                                                                     "prefix_len": shared_prefix.prefix_len},
                "tenants": None if self.tenants is None else self.tenants.to_dict(),
                "max_model_len": self.max_model_len, "seed": args.seed, "warmup": args.warmup,
                "ignore_eos": True, "stream": True,
            },
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
            "parameters": vars(args),
            "runs": self.runs,
        }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bench = Bench(args)
        workloads, warmup_items = bench.prepare()
        if warmup_items:
            bench.warm_up(warmup_items)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for run_index, (pattern, items) in enumerate(zip(bench.sweep, workloads, strict=True)):
        bench.measure(run_index, pattern, items)
    document = bench.document()
    if args.out_json:
        write_json(document, args.out_json)
        print(f"JSON written to {args.out_json}")
    if args.out_md:
        write_markdown(document, args.out_md)
        print(f"markdown written to {args.out_md}")
    if args.out_plot:
        print(write_plots(document, args.out_plot))
    return 1 if any(run["metrics"]["num_errors"] for run in bench.runs) else 0


def summary_line(label: str, m: dict) -> str:
    def ms(summary: dict, key: str) -> str:
        value = summary.get(key)
        return "-" if value is None else f"{value:.1f}"

    goodput = "" if m["goodput"] is None else f", goodput {m['goodput']:.2f} req/s"
    return (
        f"[{label}] {m['num_completed']} ok, {m['num_errors']} errors in {m['duration_s']:.1f} s: "
        f"{m['request_throughput']:.2f} req/s, {m['output_token_throughput']:.1f} out tok/s{goodput}; "
        f"TTFT p50/p99 {ms(m['ttft_ms'], 'p50')}/{ms(m['ttft_ms'], 'p99')} ms, "
        f"ITL p50/p99 {ms(m['itl_ms'], 'p50')}/{ms(m['itl_ms'], 'p99')} ms, "
        f"TPOT p50 {ms(m['tpot_ms'], 'p50')} ms, E2E p50 {ms(m['e2e_ms'], 'p50')} ms"
    )
