"""Disaggregated prefill/decode against colocated replicas: steady decoding streams while long prompts burst in.

    .venv/bin/python -m perf.pd_bench [--model smollm2|demo] [--rounds 3] [--prompt-lens 2048]
        [--steady-streams 4] [--steady-output 128] [--bursts 12] [--burst-size 1] [--burst-interval 3]

Two systems on this machine's CPUs, alternating within each round (the order reversed in the next),
each on fresh replicas (backend/server/replicas.py) pinned one CPU each:

- ``colocated``: 2 replicas (``kv_role: both``) behind vllm-router's ``round_robin``;
- ``disaggregated``: 1 prefill + 1 decode replica behind vllm-router's ``--vllm-pd-disaggregation``.

The workload, over OpenAI HTTP streams through the router: ``--steady-streams`` users each send
one short prompt after another (64 tokens, ``--steady-output`` tokens out) for the whole run, and
``--bursts`` times, ``--burst-interval`` seconds apart, ``--burst-size`` long prompts (each prompt
length of ``--prompt-lens``, 16 tokens out) arrive at once; for long prompts the interval grows
so that they bring at most ``--max-prefill-rate`` prompt tokens a second (below what one CPU
prefills: beyond it every system's queue only grows). Reported per system and prompt length:
the ITL p50/p99 of the steady streams (what a long prefill does to everyone's stream), TTFT
p50/p99 of the long prompts and of the steady ones, output tokens/s of everything, and per long
prompt the KV bytes and seconds of its transfer (the decode replica's metrics). With several prompt
lengths a PNG plots ITL p99 and TTFT p50 against the length: where disaggregation stops paying.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from backend.config import engine_config_from_model_folder
from backend.models.loader import resolve_dtype
from backend.paths import REPO_ROOT
from backend.server.replicas import Replicas
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.report import MISSING_MATPLOTLIB, save_figure, write_json
from client.bench.runner import API_OPENAI, SimulatedUser
from client.bench.stats import summarize_ms
from client.bench.workload import WorkItem
from deploy.replica_metrics import read_counters
from perf.served import RESULTS_DIR

REPOSITORIES = {"demo": REPO_ROOT / "models" / "demo-repository", "smollm2": REPO_ROOT / "model_repository"}
SYSTEMS = ("colocated", "disaggregated")
STEADY_PROMPT_TOKENS = 64
BURST_OUTPUT_TOKENS = 16
TRANSFER_COUNTERS = ("llm_kv_transfer_pulls_total", "llm_kv_transfer_fallbacks_total",
                     "llm_kv_transfer_received_bytes_total", "llm_kv_transfer_pull_seconds_sum",
                     "llm_kv_transfer_pull_seconds_count")


def start_system(system: str, model: str, overrides: dict[str, str]) -> Replicas:
    if system == "colocated":
        replicas = Replicas(2, "round_robin", model_repository=REPOSITORIES[model], overrides=overrides)
    else:
        replicas = Replicas(policy="round_robin", model_repository=REPOSITORIES[model], overrides=overrides,
                            num_prefill=1, num_decode=1)
    return replicas.start()


class Workload:
    """The prompts of one run: steady short ones (enough for any run) and the bursts' long ones."""

    def __init__(self, builder: PromptBuilder, args, prompt_len: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.steady = [WorkItem(builder.prompt(STEADY_PROMPT_TOKENS, rng), STEADY_PROMPT_TOKENS, args.steady_output)
                       for _ in range(args.steady_streams * 64)]
        self.bursts = [[WorkItem(builder.prompt(prompt_len, rng), prompt_len, BURST_OUTPUT_TOKENS)
                        for _ in range(args.burst_size)] for _ in range(args.bursts)]


def run(url: str, workload: Workload, args) -> dict:
    """Steady streams for as long as the bursts last; returns the requests' records by kind."""
    progress = Progress("pd", 0, interval_s=0)
    steady, long, lock = [], [], threading.Lock()
    stop = threading.Event()
    items = iter(workload.steady)

    def steady_user() -> None:
        user = SimulatedUser(url, "llm", args.timeout, API_OPENAI)
        try:
            while not stop.is_set():
                with lock:
                    item = next(items, None)
                if item is None:
                    return
                record = user.run(item, progress).record
                with lock:
                    steady.append(record)
        finally:
            user.close()

    def burst_user(item: WorkItem) -> None:
        user = SimulatedUser(url, "llm", args.timeout, API_OPENAI)
        try:
            record = user.run(item, progress).record
            with lock:
                long.append(record)
        finally:
            user.close()

    start = time.monotonic()
    streams = [threading.Thread(target=steady_user, daemon=True) for _ in range(args.steady_streams)]
    for thread in streams:
        thread.start()
    time.sleep(args.warmup)
    senders = []
    interval = burst_interval(args, len(workload.bursts[0]) and workload.bursts[0][0].num_input_tokens)
    for index, burst in enumerate(workload.bursts):
        delay = start + args.warmup + index * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for item in burst:
            senders.append(threading.Thread(target=burst_user, args=(item,), daemon=True))
            senders[-1].start()
    for thread in senders:
        thread.join()
    time.sleep(args.cooldown)
    stop.set()
    for thread in streams:
        thread.join()
    return {"steady": steady, "long": long, "duration_s": time.monotonic() - start}


def burst_interval(args, prompt_len: int) -> float:
    """Seconds between bursts: ``--burst-interval``, or longer where the long prompts would bring
    more than ``--max-prefill-rate`` tokens a second."""
    return max(args.burst_interval, args.burst_size * prompt_len / args.max_prefill_rate)


def summarize(records: dict, transfer: dict | None) -> dict:
    steady, long = records["steady"], records["long"]
    ok = [r for r in steady + long if r.error is None]
    itl = [gap for r in steady if r.error is None for gap in r.inter_token_latencies]
    result = {
        "itl_steady_ms": summarize_ms(itl, (50, 99, 99.9, 100)).to_dict(),
        "itl_steady_share_over_200ms": sum(1 for gap in itl if gap > 0.2) / max(1, len(itl)),
        "ttft_long_ms": summarize_ms([r.ttft for r in long if r.ttft is not None], (50, 99)).to_dict(),
        "ttft_steady_ms": summarize_ms([r.ttft for r in steady if r.ttft is not None], (50, 99)).to_dict(),
        "output_token_throughput": sum(r.num_output_tokens for r in ok) / records["duration_s"],
        "num_steady": len(steady), "num_long": len(long), "duration_s": records["duration_s"],
        "errors": [r.error for r in steady + long if r.error is not None][:5],
        "num_errors": sum(1 for r in steady + long if r.error is not None),
    }
    if transfer is not None:  # every request is pulled, the steady ones' 3 full blocks too
        pulls = transfer["llm_kv_transfer_pulls_total"]
        result["transfer"] = {
            "pulls": pulls, "fallbacks": transfer["llm_kv_transfer_fallbacks_total"],
            "bytes": transfer["llm_kv_transfer_received_bytes_total"],
            "bytes_per_pull": transfer["llm_kv_transfer_received_bytes_total"] / pulls if pulls else 0.0,
            "seconds_per_pull": (transfer["llm_kv_transfer_pull_seconds_sum"]
                                 / max(1.0, transfer["llm_kv_transfer_pull_seconds_count"])),
        }
    return result


def kv_bytes_per_token(config) -> int:
    """Bytes of one token's KV in every layer, as the transfer sends them (the cache's dtype)."""
    hf = AutoConfig.from_pretrained(config.model.model_dir)
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    dtype = resolve_dtype(config.model.dtype, None, "cpu")
    return 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_size * torch.tensor([], dtype=dtype).element_size()


def measure_system(system: str, args, workloads: dict[int, Workload], overrides: dict[str, str]) -> dict[int, dict]:
    """Fresh replicas of ``system``; every prompt length in turn on them."""
    replicas = start_system(system, args.model, overrides)
    results = {}
    try:
        decode_metrics = f"http://127.0.0.1:{replicas.ports[-1].metrics}/metrics"
        for prompt_len, workload in workloads.items():
            before = read_counters(decode_metrics, TRANSFER_COUNTERS) if system == "disaggregated" else None
            records = run(replicas.url, workload, args)
            time.sleep(1.0)  # the last counters reach /metrics
            transfer = None
            if before is not None:
                after = read_counters(decode_metrics, TRANSFER_COUNTERS)
                transfer = {name: after[name] - before[name] for name in TRANSFER_COUNTERS}
            results[prompt_len] = summarize(records, transfer)
            r = results[prompt_len]
            print(f"  [{system}, {prompt_len}-token prompts] ITL p99 {r['itl_steady_ms']['p99']:.0f} ms, "
                  f"TTFT long p50/p99 {r['ttft_long_ms']['p50']:.0f}/{r['ttft_long_ms']['p99']:.0f} ms, "
                  f"{r['output_token_throughput']:.1f} tok/s, errors {r['num_errors']}", flush=True)
    finally:
        replicas.stop()
    return results


def median(runs: list[dict], path) -> float:
    return statistics.median(path(run) for run in runs)


def table(results: dict[str, dict[int, list[dict]]], prompt_len: int, bytes_per_token: int, block_size: int) -> str:
    """Medians over rounds. The long prompt's KV is what its pull carries: its full blocks before
    the last token (the decode engine computes that one)."""
    long_kv = (prompt_len - 1) // block_size * block_size * bytes_per_token / 2**20
    lines = [f"| system ({prompt_len}-token prompts) | ITL p50 ms (steady) | ITL p99 ms (steady) | TTFT p50 ms (long) | "
             "TTFT p99 ms (long) | TTFT p50 ms (steady) | output tok/s | KV per long prompt | pull s (mean) | "
             "pulls / fallbacks | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, by_len in results.items():
        runs = by_len[prompt_len]
        transfer = runs[-1].get("transfer")
        kv = f"{long_kv:.1f} MiB" if transfer else "-"
        seconds = f"{median(runs, lambda r: r['transfer']['seconds_per_pull']):.3f}" if transfer else "-"
        counts = (f"{sum(r['transfer']['pulls'] for r in runs):.0f} / {sum(r['transfer']['fallbacks'] for r in runs):.0f}"
                  if transfer else "-")
        lines.append(
            f"| {system} | {median(runs, lambda r: r['itl_steady_ms']['p50']):.0f} | "
            f"{median(runs, lambda r: r['itl_steady_ms']['p99']):.0f} | {median(runs, lambda r: r['ttft_long_ms']['p50']):.0f} | "
            f"{median(runs, lambda r: r['ttft_long_ms']['p99']):.0f} | {median(runs, lambda r: r['ttft_steady_ms']['p50']):.0f} | "
            f"{median(runs, lambda r: r['output_token_throughput']):.1f} | {kv} | {seconds} | {counts} | "
            f"{sum(r['num_errors'] for r in runs)} |")
    return "\n".join(lines)


def ratios(results: dict[str, dict[int, list[dict]]], prompt_len: int) -> dict:
    """The goals' ratios at ``prompt_len``: colocated / disaggregated ITL p99 (higher is better),
    disaggregated / colocated TTFT p99 and throughput."""
    col, dis = results["colocated"][prompt_len], results["disaggregated"][prompt_len]
    itl = lambda runs: median(runs, lambda r: r["itl_steady_ms"]["p99"])  # noqa: E731
    ttft = lambda runs: median(runs, lambda r: r["ttft_long_ms"]["p99"])  # noqa: E731
    tput = lambda runs: median(runs, lambda r: r["output_token_throughput"])  # noqa: E731
    return {"itl_p99_colocated_over_disaggregated": itl(col) / itl(dis),
            "ttft_p99_disaggregated_over_colocated": ttft(dis) / ttft(col),
            "throughput_disaggregated_over_colocated": tput(dis) / tput(col)}


def write_plot(results: dict[str, dict[int, list[dict]]], title: str, path) -> str:
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib, the perf extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib, the perf extra)
    except ImportError:
        return MISSING_MATPLOTLIB
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, by_len in results.items():
        lengths = sorted(by_len)
        left.plot(lengths, [median(by_len[n], lambda r: r["itl_steady_ms"]["p99"]) for n in lengths], marker="o",
                  label=system)
        right.plot(lengths, [median(by_len[n], lambda r: r["ttft_long_ms"]["p50"]) for n in lengths], marker="o",
                   label=system)
    for axis, label in ((left, "ITL p99 of the steady streams, ms"), (right, "TTFT p50 of the long prompts, ms")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("long prompt length, tokens")
        axis.set_ylabel(f"{label} (lower is better)")
        axis.legend()
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.pd_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(REPOSITORIES), default="smollm2")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-lens", default="2048", help="comma-separated long prompt lengths (tokens)")
    parser.add_argument("--steady-streams", type=int, default=4)
    parser.add_argument("--steady-output", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=12)
    parser.add_argument("--burst-size", type=int, default=1)
    parser.add_argument("--burst-interval", type=float, default=3.0, help="seconds between bursts (at least)")
    parser.add_argument("--max-prefill-rate", type=float, default=700.0,
                        help="long-prompt tokens a second at most (longer prompts arrive less often)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of steady streams before the first burst")
    parser.add_argument("--cooldown", type=float, default=3.0, help="seconds of steady streams after the last long prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "pd_bench.json"))
    args = parser.parse_args(argv)
    config = engine_config_from_model_folder(str(REPOSITORIES[args.model] / "llm"))
    dtype = str(resolve_dtype(config.model.dtype, None, "cpu")).removeprefix("torch.")
    builder = PromptBuilder(config.model.tokenizer_dir)
    lengths = [int(n) for n in args.prompt_lens.split(",") if n]
    overrides = {"max_num_seqs": "16", "num_kv_blocks": str(max(1024, 4 * max(lengths) // 16 + 512))}
    systems = [s for s in args.systems.split(",") if s]
    results: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in lengths} for s in systems}
    for round_index in range(args.rounds):
        # Fresh prompts every round (no prefix hits across rounds); the same ones for both systems.
        workloads = {n: Workload(builder, args, n, args.seed + 1000 * round_index + n) for n in lengths}
        order = systems if round_index % 2 == 0 else systems[::-1]
        for system in order:
            print(f"[round {round_index + 1}/{args.rounds}] {system}: starting replicas...", flush=True)
            for prompt_len, result in measure_system(system, args, workloads, overrides).items():
                results[system][prompt_len].append(result)
    tables = "\n\n".join(table(results, n, kv_bytes_per_token(config), config.cache.block_size) for n in lengths)
    print(tables)
    summary = {n: ratios(results, n) for n in lengths} if set(SYSTEMS) <= set(systems) else {}
    for n, r in summary.items():
        print(f"{n}-token prompts: ITL p99 colocated/disaggregated {r['itl_p99_colocated_over_disaggregated']:.2f}x, "
              f"TTFT p99 disaggregated/colocated {r['ttft_p99_disaggregated_over_colocated']:.2f}x, "
              f"throughput disaggregated/colocated {r['throughput_disaggregated_over_colocated']:.2f}x")
    document = {"tool": "perf.pd_bench", "created": now_iso(), "git": git_state(), "machine": machine_info(),
                "model": args.model, "dtype": dtype, "settings": vars(args), "overrides": overrides,
                "results": {s: {str(n): runs for n, runs in by_len.items()} for s, by_len in results.items()},
                "ratios": {str(n): r for n, r in summary.items()}, "tables": tables}
    write_json(document, args.out)
    print(f"written to {args.out}")
    if len(lengths) > 1:
        title = (f"{args.model} ({dtype}): 2 colocated replicas vs 1 prefill + 1 decode, one CPU each; "
                 f"{args.steady_streams} steady streams, bursts of {args.burst_size}; "
                 f"commit {(document['git']['commit'] or '?')[:7]}")
        print(write_plot(results, title, Path(args.out).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
