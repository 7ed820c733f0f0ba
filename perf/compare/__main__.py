"""One workload, one model, every system one after the other, one table of ratios.

    .venv/bin/python -m perf.compare [--systems triton,triton-thread,engine,vllm,hf-continuous,hf-static] \\
        [--num-requests 32] [--input-len uniform:32:256] [--output-len uniform:32:128] [--out-dir DIR]

Systems (same prompts, same forced output lengths, greedy, same dtype):

* ``triton``: our ``llm`` model in tritonserver, gRPC streaming through client.bench (the engine
  core in its own process, the default; the engine-core IPC cost per step comes from the
  server's ``llm_engine_core_ipc_seconds`` histogram);
* ``triton-thread``: the same with ``engine_process: false`` (the engine on a thread of the stub);
* ``engine``: our engine in-process (perf.compare.engine_in_process), no server;
* ``engine-torch-attention``: the same with ``attention_backend: torch`` (decode attention by
  gather + SDPA instead of the CPU kernels), and ``engine-no-fused-ops`` with
  ``cpu_fused_ops: false`` (torch's RMSNorm, SiLU x up and rotary instead of the fused kernels,
  which are on by default), to measure each;
* ``vllm``: vLLM's CPU build from ``make peers`` through its OpenAI streaming endpoint, with the
  same load generator (``--api openai``); run in the ``default`` and ``tuned`` setups
  (perf.compare.vllm_server) and compared against the better one;
* ``hf-continuous``: transformers' own continuous batching (perf.compare.transformers_continuous);
* ``hf-static``: transformers ``generate()`` in arrival-order batches padded and run to their
  longest member (request-level static batching).

The serving systems and our engine see the requests under ``--concurrency`` (closed loop, default:
all requests at once) or ``--request-rate``; the two transformers systems are offline and always
get every request at t=0. Throughput counts the tokens each system reports having generated.
Results: a markdown table (stdout and ``compare.md``), ``compare.json`` with every number, the
configs, commit and machine, and ``compare.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from backend.paths import REPO_ROOT
from client.bench.arrivals import ArrivalPattern
from client.bench.lengths import parse_length
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.runner import API_OPENAI, API_TRITON, count_length_mismatches, run_workload
from client.bench.stats import compute_metrics
from client.bench.workload import build_workload
from perf.compare.cpu_meter import CpuMeter
from perf.compare.report import SystemResult, markdown_report, medians_report, write_plot

ALL_SYSTEMS = ("triton", "triton-thread", "engine", "engine-no-fused-ops", "engine-torch-attention", "vllm",
               "hf-continuous", "hf-static")


TRITON_THREAD_NAME = "In-thread engine, Triton llm (engine_process false)"


def run_triton(args, items, warmup, pattern, in_thread: bool):
    """Our `llm` model in tritonserver: (completed, duration, CpuMeter, engine-core IPC summary or None)."""
    from backend.server.launcher import start_server
    from perf.compare.histogram import histogram_median, scrape_histogram
    from perf.compare.repository import repository_with_overrides

    # The server must load the same engine settings as the in-process run: always the dtype, since
    # config.pbtxt's `auto` is bfloat16 on CPU (before this, --dtype float32 served bfloat16).
    overrides = {"dtype": args.dtype}
    if in_thread:
        overrides["engine_process"] = "false"
    repository = repository_with_overrides(Path(args.model_repository), args.model, overrides,
                                           REPO_ROOT / "build" / "compare_repository")
    server = start_server(repository, ready_timeout=300)
    try:
        run_workload(server.grpc_url, args.model, warmup, ArrivalPattern("concurrency", 1))
        before = scrape_histogram(server.metrics_url, "llm_engine_core_ipc_seconds")
        cpu = CpuMeter(server.process.pid)
        label = ("triton-thread " if in_thread else "triton ") + pattern.label
        with Progress(label, len(items), args.progress_interval) as progress:
            completed, duration = run_workload(server.grpc_url, args.model, items, pattern, seed=args.seed,
                                               progress=progress, api=API_TRITON,
                                               shared_stream=args.triton_client == "shared-stream")
        cpu.stop()
        after = scrape_histogram(server.metrics_url, "llm_engine_core_ipc_seconds")
    finally:
        server.stop()
    ipc = histogram_median(before, after)
    return completed, duration, cpu, ipc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf.compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--model", default="llm", help="the Triton model, and the engine's config.pbtxt folder")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", default="uniform:32:256", help="client.bench length spec (default: %(default)s)")
    parser.add_argument("--output-len", default="uniform:32:128", help="client.bench length spec (default: %(default)s)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed-loop users (default: all requests at once)")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="every system's weights and activations (default: %(default)s)")
    parser.add_argument("--triton-client", default="shared-stream", choices=("shared-stream", "stream-per-user"),
                        help="the load generator's gRPC streams for the Triton systems: every request on one "
                             "stream (default; the client shares these 2 cores with the server), or one stream "
                             "and client per simulated user")
    parser.add_argument("--static-batch-size", type=int, default=32, help="hf-static batch size (default: %(default)s)")
    parser.add_argument("--vllm-setups", default="default,tuned", help="vLLM setups to run (default: %(default)s)")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "compare")
    parser.add_argument("--progress-interval", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the systems this many times, alternating, and add a table of medians "
                             "(this machine is shared and noisy: one run can be 10%% off)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(ALL_SYSTEMS))
    if unknown:
        print(f"error: --systems: unknown {unknown}; choose from {', '.join(ALL_SYSTEMS)}", file=sys.stderr)
        return 2
    from backend.config import engine_config_from_model_folder

    model_folder = str(Path(args.model_repository) / args.model)
    engine_config = engine_config_from_model_folder(model_folder, dtype=args.dtype)
    model_dir = engine_config.model.model_dir
    max_model_len = engine_config.model.max_model_len
    builder = PromptBuilder(engine_config.model.tokenizer_dir or model_dir)
    items = build_workload(builder, args.num_requests, parse_length(args.input_len), parse_length(args.output_len),
                           args.seed, max_model_len=max_model_len)
    token_requests = [(builder.tokenizer.encode(item.prompt, add_special_tokens=True).ids, item.max_tokens)
                      for item in items]
    assert all(len(ids) == item.num_input_tokens for (ids, _), item in zip(token_requests, items, strict=True))
    warmup = build_workload(builder, 1, parse_length("16"), parse_length("4"), args.seed + 99)
    if args.request_rate:
        pattern = ArrivalPattern("rate", args.request_rate)
    else:
        pattern = ArrivalPattern("concurrency", args.concurrency or args.num_requests)
    offline = ArrivalPattern("concurrency", args.num_requests)
    print(f"workload: {len(items)} requests, {sum(i.num_input_tokens for i in items)} prompt tokens, "
          f"{sum(i.max_tokens for i in items)} output tokens, {pattern.label}; dtype {args.dtype}", flush=True)

    results: list[SystemResult] = []
    extra: dict[str, dict] = {}

    current_run = [0]  # which of the --repeat runs is going on

    def note(result: SystemResult) -> None:
        if args.repeat > 1:
            result.name = f"{result.name} [run {current_run[0] + 1}]"
        results.append(result)
        print(f"  {result.name}: {result.output_tokens} tokens in {result.duration_s:.1f} s = "
              f"{result.output_token_throughput:.1f} out tok/s", flush=True)

    def served_result(name: str, completed, duration: float, load_before: float, cpu: CpuMeter) -> SystemResult:
        records = [c.record for c in completed]
        result = SystemResult.from_metrics(name, compute_metrics(records, duration), pattern.label,
                                           mismatched=count_length_mismatches(completed),
                                           load=(load_before, os.getloadavg()[0]))
        result.server_cpu_s, result.client_cpu_s = cpu.server_seconds(), cpu.client_seconds()
        return result

    for run, system in [(r, s) for r in range(args.repeat) for s in systems]:
        current_run[0] = run
        load_before = os.getloadavg()[0]
        print(f"\n== {system} ==", flush=True)
        if system in ("triton", "triton-thread"):
            in_thread = system == "triton-thread"
            completed, duration, cpu, ipc = run_triton(args, items, warmup, pattern, in_thread)
            if ipc is not None:
                key = system if args.repeat == 1 else f"{system} [run {run + 1}]"
                extra.setdefault("engine_core_ipc", {})[key] = ipc
                print(f"  engine-core IPC per step: median {ipc['median_us']:.0f} us over {ipc['count']} steps")
            name = TRITON_THREAD_NAME if in_thread else "Triton llm (gRPC streaming)"
            note(served_result(name, completed, duration, load_before, cpu))
        elif system in ("engine", "engine-no-fused-ops", "engine-torch-attention"):
            from perf.compare.engine_in_process import run_engine_in_process

            overrides = {"dtype": args.dtype}
            name = "our engine in-process"
            if system == "engine-torch-attention":  # the torch path: no CPU kernel at all
                overrides["attention_backend"] = "torch"
                name += ", torch attention"
            if system == "engine-no-fused-ops":  # the attention kernels, torch for the layers' small ops
                overrides["cpu_fused_ops"] = "false"
                name += ", no fused ops"
            records, duration, summary = run_engine_in_process(model_folder, token_requests, pattern,
                                                               overrides, args.seed, args.progress_interval)
            extra[system] = summary
            result = SystemResult.from_metrics(name, compute_metrics(records, duration),
                                               pattern.label, load=(load_before, os.getloadavg()[0]))
            result.server_cpu_s = summary["cpu_s"]
            note(result)
        elif system == "vllm":
            from perf.compare.vllm_server import start_vllm, vllm_version

            extra["vllm"] = {"versions": vllm_version(), "setups": {}}
            for setup in [s.strip() for s in args.vllm_setups.split(",") if s.strip()]:
                load_before = os.getloadavg()[0]
                print(f"starting vLLM ({setup})...", flush=True)
                server = start_vllm(model_dir, setup, args.dtype, max_model_len, engine_config.scheduler.max_num_seqs,
                                    args.vllm_kv_cache_gib, log_dir=args.out_dir)
                try:
                    from perf.compare.vllm_server import SERVED_MODEL_NAME

                    run_workload(server.url, SERVED_MODEL_NAME, warmup, ArrivalPattern("concurrency", 1), api=API_OPENAI)
                    cpu = CpuMeter(server.process.pid)
                    with Progress(f"vllm-{setup} " + pattern.label, len(items), args.progress_interval) as progress:
                        completed, duration = run_workload(server.url, SERVED_MODEL_NAME, items, pattern,
                                                           seed=args.seed, progress=progress, api=API_OPENAI)
                    cpu.stop()
                finally:
                    server.stop()
                extra["vllm"]["setups"][setup] = {"env": server.env, "log": str(server.log_path)}
                note(served_result(f"vLLM CPU, {setup} (OpenAI streaming)", completed, duration, load_before, cpu))
        elif system == "hf-continuous":
            from perf.compare.transformers_continuous import run_transformers_continuous

            done = run_transformers_continuous(model_dir, token_requests, progress_interval_s=args.progress_interval)
            extra["hf-continuous"] = done.get("config", {})
            note(SystemResult.offline("transformers continuous batching (ContinuousBatchingManager)", done,
                                      offline.label, load=(load_before, os.getloadavg()[0])))
        elif system == "hf-static":
            from perf.bench_engine import run_static

            done = run_static(model_dir, token_requests, args.static_batch_size, dtype=args.dtype)
            note(SystemResult.offline(f"transformers static batching (batch {args.static_batch_size})", done,
                                      offline.label, load=(load_before, os.getloadavg()[0])))

    document = {
        "tool": "perf.compare", "created": now_iso(), "git": git_state(), "machine": machine_info(),
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                     "arrival": pattern.to_dict(), "seed": args.seed, "dtype": args.dtype,
                     "triton_client": args.triton_client,
                     "prompt_tokens": sum(i.num_input_tokens for i in items),
                     "output_tokens": sum(i.max_tokens for i in items)},
        "model_dir": model_dir, "engine_config": str(engine_config), "systems": extra,
        "results": [r.to_dict() for r in results], "finished_at": time.time(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = markdown_report(document, results)
    if args.repeat > 1:
        report += "\n" + medians_report(results)
    print("\n" + report)
    (args.out_dir / "compare.md").write_text(report)
    (args.out_dir / "compare.json").write_text(json.dumps(document, indent=2))
    print(write_plot(results, args.out_dir / "compare.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
