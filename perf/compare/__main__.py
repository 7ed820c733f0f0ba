"""One workload, one model, every system one after the other, one table of ratios.

    .venv/bin/python -m perf.compare [--systems triton,triton-thread,engine,vllm,hf-continuous,hf-static] \\
        [--num-requests 32] [--input-len uniform:32:256] [--output-len uniform:32:128] [--out-dir DIR]

Systems (same prompts, same forced output lengths, greedy, same dtype):

* ``triton``: our ``llm`` model in tritonserver, gRPC streaming through client.bench (the engine
  core in its own process, the default; the engine-core IPC cost per step comes from the
  server's ``llm_engine_core_ipc_seconds`` histogram);
* ``triton-thread``: the same with ``engine_process: false`` (the engine on a thread of the stub);
* ``triton-http``: the same ``llm`` model through Triton's HTTP generate_stream endpoint, a kept-alive
  connection per user (client.triton_http_stream): no gRPC client machinery on the cores the
  server shares; not in the default set;
* ``triton-no-coalescing``: the ``llm`` model with ``response_coalescing: false`` (one response per
  engine step per request; not in the default set), ``triton-stream-interval-8`` the same with
  ``stream_interval: 8`` (a response per 8 tokens); ``triton-fixed-threads`` with
  ``cpu_adaptive_threads: false`` (the engine's CPU threads never cut, what its governor costs);
* ``triton-iterative``: the ``llm_iterative`` model (Triton's sequence batcher drives the engine,
  strategy ``oldest`` as shipped), and ``triton-iterative-direct`` the same with the ``direct``
  strategy; not in the default set (run them with ``--systems``);
* ``engine``: our engine in-process (perf.compare.engine_in_process), no server;
* ``engine-torch-attention``: the same with ``attention_backend: torch`` (decode attention by
  gather + SDPA instead of the CPU kernels), and ``engine-no-fused-ops`` with
  ``cpu_fused_ops: false`` (torch's RMSNorm, SiLU x up and rotary instead of the fused kernels,
  which are on by default), to measure each;
* ``vllm``: vLLM's CPU build from ``make peers`` through its OpenAI streaming endpoint, with the
  same load generator (``--api openai``) and our max_num_seqs and max_num_batched_tokens; run in the ``default`` and ``tuned`` setups
  (perf.compare.vllm_server) and compared against the better one;
* ``triton-vllm-backend``: Triton's own vllm_backend (its model.py at a pinned commit, ``make
  peer-vllm-backend``) on that vLLM, in our tritonserver, driven like ``triton`` (gRPC streaming);
  perf.compare.vllm_backend; not in the default set;
* ``hf-continuous``: transformers' own continuous batching (perf.compare.transformers_continuous);
* ``hf-static``: transformers ``generate()`` in arrival-order batches padded and run to their
  longest member (request-level static batching; perf.compare.transformers_static).

The serving systems and our engine see the requests under ``--concurrency`` (closed loop, default:
all requests at once) or ``--request-rate``; the two transformers systems are offline and always
get every request at t=0. A list (``--concurrency 1,8,32``) is a sweep: each serving system runs
every point on one server, each point with its own prompts (seed + i x client.bench's stride, so no
point hits the prefix cache another filled; the first point's are the single run's), and the
table has a row per system and point, its ratios against ours at the same point. Throughput counts the tokens each system reports having generated.
Results: a markdown table (stdout and ``compare.md``), ``compare.json`` with every number, the
configs, commit and machine, and ``compare.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.paths import REPO_ROOT
from client.bench.arrivals import ArrivalPattern, parse_sweep
from client.bench.completed import count_length_mismatches
from client.bench.lengths import parse_length
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.runner import API_OPENAI, run_workload
from client.bench.stats import compute_metrics
from client.bench.triton_clients import TRITON_CLIENTS, client_url, run_triton_workload
from client.bench.workload import RUN_SEED_STRIDE, build_workload, token_requests
from perf.compare.cpu_meter import CpuMeter
from perf.compare.engine_in_process import run_engine_in_process
from perf.compare.histogram import histogram_median, scrape_histogram
from perf.compare.report import SystemResult, markdown_report, medians_report, write_plot
from perf.compare.transformers_continuous import run_transformers_continuous
from perf.compare.transformers_static import run_static
from perf.compare.vllm_backend import RESULT_NAME, run_vllm_backend
from perf.compare.vllm_server import SERVED_MODEL_NAME, start_vllm, vllm_version
from perf.idle_cpu import wait_until_quiet
from perf.served import tritonserver

DEFAULT_SYSTEMS = ("triton", "triton-thread", "engine", "engine-no-fused-ops", "engine-torch-attention", "vllm",
                   "hf-continuous", "hf-static")
ALL_SYSTEMS = (*DEFAULT_SYSTEMS, "triton-aio", "triton-no-coalescing", "triton-stream-interval-8", "triton-iterative",
               "triton-iterative-direct", "triton-vllm-backend", "triton-fixed-threads", "triton-http")


TRITON_THREAD_NAME = "In-thread engine, Triton llm (engine_process false)"
DIRECT_BATCHING = """sequence_batching {
  iterative_sequence: true
  max_sequence_idle_microseconds: 600000000
  direct {
    max_queue_delay_microseconds: 0
  }
}"""


def direct_strategy(config: str) -> str:
    """llm_iterative's config.pbtxt with the sequence batcher's ``direct`` strategy instead of ``oldest``."""
    text, count = re.subn(r"sequence_batching \{.*?\n\}", DIRECT_BATCHING, config, count=1, flags=re.S)
    if count != 1:
        raise ValueError("config.pbtxt has no sequence_batching block")
    return text


# system -> (served model, extra config.pbtxt overrides, config edit, result name)
TRITON_SYSTEMS = {
    "triton": ("llm", {}, None, "Triton llm (gRPC streaming)"),
    "triton-thread": ("llm", {"engine_process": "false"}, None, TRITON_THREAD_NAME),
    "triton-aio": ("llm", {}, None, "Triton llm, asyncio load generator (a stream per user)"),
    "triton-http": ("llm", {}, None, "Triton llm, HTTP generate_stream (a connection per user)"),
    "triton-no-coalescing": ("llm", {"response_coalescing": "false"}, None,
                             "One response per step, Triton llm (response_coalescing false)"),
    "triton-stream-interval-8": ("llm", {"stream_interval": "8"}, None, "Stream interval 8, Triton llm"),
    "triton-fixed-threads": ("llm", {"cpu_adaptive_threads": "false"}, None,
                             "Fixed CPU threads, Triton llm (cpu_adaptive_threads false)"),
    "triton-iterative": ("llm_iterative", {}, None, "llm_iterative in Triton (sequence batcher, oldest)"),
    "triton-iterative-direct": ("llm_iterative", {}, direct_strategy,
                                "llm_iterative in Triton (sequence batcher, direct)"),
}


# systems whose load generator holds its streams its own way, whatever --triton-client says
SYSTEM_CLIENTS = {"triton-aio": "aio-stream-per-user", "triton-http": "http-stream-per-user"}


def settle(pgid: int) -> None:
    """Waits, after a served system's warm-up, until its processes are quiet (perf.idle_cpu)."""
    waited = wait_until_quiet(pgid)
    print(f"  server quiet after {waited:.1f} s", flush=True)


def run_triton(args, system: str, runs, warmup, load_before: float) -> list:
    """One of our models in tritonserver, every (pattern, items) of ``runs`` on the same server:
    per run (completed, duration, CpuMeter, engine-core IPC summary or None, load average at its
    start; the first run's is ``load_before``, taken before the server started)."""
    model, extra, edit, _ = TRITON_SYSTEMS[system]
    # The server must load the same engine settings as the in-process run: always the dtype, since
    # config.pbtxt's `auto` is bfloat16 on CPU (before this, --dtype float32 served bfloat16).
    overrides = {"dtype": args.dtype, **extra}
    measured = []
    with tritonserver(Path(args.model_repository), overrides, model, edit=edit) as server:
        run_workload(server.grpc_url, model, warmup, ArrivalPattern("concurrency", 1))
        settle(server.process.pid)
        for index, (pattern, items) in enumerate(runs):
            load = load_before if index == 0 else os.getloadavg()[0]
            before = scrape_histogram(server.metrics_url, "llm_engine_core_ipc_seconds")
            cpu = CpuMeter(server.process.pid)
            client = SYSTEM_CLIENTS.get(system, args.triton_client)
            with Progress(f"{system} {pattern.label}", len(items), args.progress_interval) as progress:
                completed, duration = run_triton_workload(client_url(server, client), model, items, pattern,
                                                          client, seed=args.seed, progress=progress)
            cpu.stop()
            after = scrape_histogram(server.metrics_url, "llm_engine_core_ipc_seconds")
            measured.append((completed, duration, cpu, histogram_median(before, after), load))
    return measured


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf.compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, of {', '.join(ALL_SYSTEMS)} (default: %(default)s)")
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--model", default="llm", help="the Triton model, and the engine's config.pbtxt folder")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", default="uniform:32:256", help="client.bench length spec (default: %(default)s)")
    parser.add_argument("--output-len", default="uniform:32:128", help="client.bench length spec (default: %(default)s)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="closed-loop users, a list sweeps (e.g. 1,8,32; default: all requests at once)")
    load.add_argument("--request-rate", default=None, help="Poisson arrivals, requests/s; a list sweeps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="every system's weights and activations (default: %(default)s)")
    parser.add_argument("--triton-client", default="shared-stream", choices=TRITON_CLIENTS,
                        help="the load generator's gRPC streams for the Triton systems: every request on one "
                             "stream (default; the client shares these 2 cores with the server), one stream "
                             "and client per simulated user (threads), or one stream per user on one asyncio "
                             "loop (client.bench.triton_clients)")
    parser.add_argument("--static-batch-size", type=int, default=32, help="hf-static batch size (default: %(default)s)")
    parser.add_argument("--vllm-setups", default="default,tuned", help="vLLM setups to run (default: %(default)s)")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "compare")
    parser.add_argument("--progress-interval", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the systems this many times, alternating, and add a table of medians "
                             "(a shared machine's noise moves single runs)")
    return parser


def arrival_patterns(args) -> list[ArrivalPattern]:
    if args.request_rate:
        return parse_sweep(args.request_rate, "rate")
    return parse_sweep(args.concurrency or str(args.num_requests), "concurrency")


class CompareSession:
    """One invocation: the workload of every arrival pattern, the systems' results in order, and
    what each system adds to the document (``extra``)."""

    def __init__(self, args, patterns: list[ArrivalPattern]):
        self.args, self.patterns = args, patterns
        self.model_folder = str(Path(args.model_repository) / args.model)
        self.engine_config = engine_config_from_model_folder(self.model_folder, dtype=args.dtype)
        self.model_dir = self.engine_config.model.model_dir
        self.max_model_len = self.engine_config.model.max_model_len
        builder = PromptBuilder(self.engine_config.model.tokenizer_dir or self.model_dir)
        # One workload per arrival pattern (the first one's is the single run's): (pattern, items).
        self.runs = [(pattern, build_workload(builder, args.num_requests, parse_length(args.input_len),
                                              parse_length(args.output_len), args.seed + index * RUN_SEED_STRIDE,
                                              max_model_len=self.max_model_len))
                     for index, pattern in enumerate(patterns)]
        self.token_runs = [(run_pattern, token_requests(builder, run_items)) for run_pattern, run_items in self.runs]
        self.warmup = build_workload(builder, 1, parse_length("16"), parse_length("4"), args.seed + 99)
        self.offline = ArrivalPattern("concurrency", args.num_requests)
        self.results: list[SystemResult] = []
        self.extra: dict[str, dict] = {}
        self.current_run = 0  # which of the --repeat runs is going on

    @property
    def items(self):
        return self.runs[0][1]

    def key(self, system: str, at: ArrivalPattern, with_run: bool) -> str:
        """``system`` as a key of the document's systems, naming the point of a sweep (and the run)."""
        name = system if len(self.patterns) == 1 else f"{system} {at.label}"
        return f"{name} [run {self.current_run + 1}]" if with_run and self.args.repeat > 1 else name

    def note(self, result: SystemResult) -> None:
        if self.args.repeat > 1:
            result.name = f"{result.name} [run {self.current_run + 1}]"
        self.results.append(result)
        at = "" if len(self.patterns) == 1 else f" ({result.arrival})"
        print(f"  {result.name}{at}: {result.output_tokens} tokens in {result.duration_s:.1f} s = "
              f"{result.output_token_throughput:.1f} out tok/s", flush=True)

    @staticmethod
    def served_result(name: str, at: ArrivalPattern, completed, duration: float, load_before: float,
                      cpu: CpuMeter) -> SystemResult:
        records = [c.record for c in completed]
        errors = [r.error for r in records if r.error]
        if errors:  # what went wrong, not only how often
            print(f"  {len(errors)} requests failed; the first: {errors[0]}", flush=True)
        result = SystemResult.from_metrics(name, compute_metrics(records, duration), at.label,
                                           mismatched=count_length_mismatches(completed),
                                           load=(load_before, os.getloadavg()[0]))
        result.server_cpu_s, result.client_cpu_s = cpu.server_seconds(), cpu.client_seconds()
        result.cpu_s_by_process = cpu.seconds_by_role()
        result.token_responses = sum(len(r.token_times) for r in records)
        return result

    def run_system(self, system: str) -> None:
        load_before = os.getloadavg()[0]
        print(f"\n== {system} ==", flush=True)
        if system in TRITON_SYSTEMS:
            self.run_triton_system(system, load_before)
        elif system in ("engine", "engine-no-fused-ops", "engine-torch-attention"):
            self.run_engine(system, load_before)
        elif system == "vllm":
            self.run_vllm()
        elif system == "triton-vllm-backend":
            self.run_vllm_backend(system, load_before)
        elif system == "hf-continuous":
            done = run_transformers_continuous(self.model_dir, self.token_runs[0][1],
                                               progress_interval_s=self.args.progress_interval)
            self.extra["hf-continuous"] = done.get("config", {})
            self.note(SystemResult.offline("transformers continuous batching (ContinuousBatchingManager)", done,
                                           self.offline.label, load=(load_before, os.getloadavg()[0])))
        elif system == "hf-static":
            done = run_static(self.model_dir, self.token_runs[0][1], self.args.static_batch_size, dtype=self.args.dtype)
            self.note(SystemResult.offline(f"transformers static batching (batch {self.args.static_batch_size})", done,
                                           self.offline.label, load=(load_before, os.getloadavg()[0])))

    def run_triton_system(self, system: str, load_before: float) -> None:
        measured = run_triton(self.args, system, self.runs, self.warmup, load_before)
        for (at, _), (completed, duration, cpu, ipc, started_load) in zip(self.runs, measured, strict=True):
            if ipc is not None:
                self.extra.setdefault("engine_core_ipc", {})[self.key(system, at, True)] = ipc
                print(f"  engine-core IPC per step: median {ipc['median_us']:.0f} us over {ipc['count']} steps")
            self.note(self.served_result(TRITON_SYSTEMS[system][3], at, completed, duration, started_load, cpu))

    def run_engine(self, system: str, load_before: float) -> None:
        overrides = {"dtype": self.args.dtype}
        name = "our engine in-process"
        if system == "engine-torch-attention":  # the torch path: no CPU kernel at all
            overrides["attention_backend"] = "torch"
            name += ", torch attention"
        if system == "engine-no-fused-ops":  # the attention kernels, torch for the layers' small ops
            overrides["cpu_fused_ops"] = "false"
            name += ", no fused ops"
        for at, requests in self.token_runs:
            records, duration, summary = run_engine_in_process(self.model_folder, requests, at, overrides,
                                                               self.args.seed, self.args.progress_interval)
            self.extra[self.key(system, at, False)] = summary
            result = SystemResult.from_metrics(name, compute_metrics(records, duration),
                                               at.label, load=(load_before, os.getloadavg()[0]))
            result.server_cpu_s = summary["cpu_s"]
            result.cpu_s_by_process = {"engine (in-process)": summary["cpu_s"]}
            self.note(result)
            load_before = os.getloadavg()[0]

    def run_vllm(self) -> None:
        self.extra["vllm"] = {"versions": vllm_version(), "setups": {}}
        for setup in [s.strip() for s in self.args.vllm_setups.split(",") if s.strip()]:
            self.run_vllm_setup(setup)

    def run_vllm_setup(self, setup: str) -> None:
        args, scheduler = self.args, self.engine_config.scheduler
        load_before = os.getloadavg()[0]
        print(f"starting vLLM ({setup})...", flush=True)
        server = start_vllm(self.model_dir, setup, args.dtype, self.max_model_len, scheduler.max_num_seqs,
                            args.vllm_kv_cache_gib, log_dir=args.out_dir,
                            max_num_batched_tokens=scheduler.max_num_batched_tokens)
        measured = []
        try:
            run_workload(server.url, SERVED_MODEL_NAME, self.warmup, ArrivalPattern("concurrency", 1), api=API_OPENAI)
            settle(server.process.pid)
            for at, run_items in self.runs:
                cpu = CpuMeter(server.process.pid)
                with Progress(f"vllm-{setup} " + at.label, len(run_items), args.progress_interval) as progress:
                    completed, duration = run_workload(server.url, SERVED_MODEL_NAME, run_items, at,
                                                       seed=args.seed, progress=progress, api=API_OPENAI)
                cpu.stop()
                measured.append((at, completed, duration, load_before, cpu))
                load_before = os.getloadavg()[0]
        finally:
            server.stop()
        self.extra["vllm"]["setups"][setup] = {"env": server.env, "log": str(server.log_path)}
        for at, completed, duration, started_load, cpu in measured:
            self.note(self.served_result(f"vLLM CPU, {setup} (OpenAI streaming)", at, completed, duration,
                                         started_load, cpu))

    def run_vllm_backend(self, system: str, load_before: float) -> None:
        scheduler = self.engine_config.scheduler
        measured, self.extra[system] = run_vllm_backend(self.args, self.runs, self.warmup, load_before, self.model_dir,
                                                        self.max_model_len, scheduler.max_num_seqs,
                                                        scheduler.max_num_batched_tokens)
        for (at, _), (completed, duration, cpu, _ipc, started_load) in zip(self.runs, measured, strict=True):
            self.note(self.served_result(RESULT_NAME, at, completed, duration, started_load, cpu))

    def write(self) -> None:
        """compare.md, compare.json and compare.png under --out-dir; the report printed."""
        args, items, pattern = self.args, self.items, self.runs[0][0]
        document = {
            "tool": "perf.compare", "created": now_iso(), "git": git_state(), "machine": machine_info(),
            "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                         "arrival": pattern.to_dict(), "seed": args.seed, "dtype": args.dtype,
                         **({"arrivals": [p.to_dict() for p in self.patterns]} if len(self.patterns) > 1 else {}),
                         "triton_client": args.triton_client,
                         "prompt_tokens": sum(i.num_input_tokens for i in items),
                         "output_tokens": sum(i.max_tokens for i in items)},
            "model_dir": self.model_dir, "engine_config": str(self.engine_config), "systems": self.extra,
            "results": [r.to_dict() for r in self.results], "finished_at": time.time(),
        }
        args.out_dir.mkdir(parents=True, exist_ok=True)
        report = markdown_report(document, self.results)
        if args.repeat > 1:
            report += "\n" + medians_report(self.results)
        print("\n" + report)
        (args.out_dir / "compare.md").write_text(report)
        (args.out_dir / "compare.json").write_text(json.dumps(document, indent=2))
        print(write_plot(self.results, args.out_dir / "compare.png"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(ALL_SYSTEMS))
    if unknown:
        print(f"error: --systems: unknown {unknown}; choose from {', '.join(ALL_SYSTEMS)}", file=sys.stderr)
        return 2
    try:
        patterns = arrival_patterns(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    session = CompareSession(args, patterns)
    items = session.items
    print(f"workload: {len(items)} requests, {sum(i.num_input_tokens for i in items)} prompt tokens, "
          f"{sum(i.max_tokens for i in items)} output tokens, {', '.join(p.label for p in patterns)}; "
          f"dtype {args.dtype}", flush=True)
    for run, system in [(r, s) for r in range(args.repeat) for s in systems]:
        session.current_run = run
        session.run_system(system)
    session.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
