"""The served ``llm`` model beside a busy process: one stream's decode speed and the engine core's CPU
seconds, alone and with a CPU-bound process running in another session, under OpenMP's default
wait policy, ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once) and shorter spins
(``GOMP_SPINCOUNT``: how long a waiting thread spins before it sleeps). A policy name with
``+fixed`` (``default+fixed``) also turns the engine's thread governor off (``cpu_adaptive_threads:
false``, backend/engine/cpu_threads.py): its torch threads then stay at one per core.

Linux's autogroup gives each session a fair share of the CPUs whatever the nice values, so one busy
process started elsewhere (a shell, a cron job, another server) leaves tritonserver's session about
one core of two. The engine core's OpenMP threads then share that core, and a thread that spins at
a barrier waiting for one that is not running burns the time the other needs. Each policy gets a
server of its own (OMP_* is read at process start; the engine core inherits tritonserver's
environment), all started at once; each round streams once from each server alone and once beside
the busy process, in an order that turns around every other round.

    .venv/bin/python -m perf.cpu_contention [--policies default,default+fixed,spin1k+fixed] [--max-tokens 64] \\
        [--repeat 3] [--model-repository DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from backend.paths import REPO_ROOT
from client.bench.metadata import git_state, machine_info, now_iso
from client.stream import StreamingClient
from perf.compare.cpu_meter import CpuMeter
from perf.runtime_settings import OPENMP_WAITS
from perf.served import DEFAULT_MODEL_REPOSITORY, tritonserver

POLICIES = OPENMP_WAITS  # name -> the OpenMP settings of tritonserver's environment
FIXED_THREADS = "+fixed"  # a policy's suffix: cpu_adaptive_threads false
ENGINE_CORE_ROLE = "engine core llm"  # perf.compare.cpu_meter's name for the llm model's core process
PROMPT = "Write a short story about a lighthouse keeper."


def start_busy_neighbor() -> subprocess.Popen:
    """A CPU-bound process in a session of its own (so its own autogroup), as any other job would be."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def one_stream(grpc_url: str, model: str, max_tokens: int, pgid: int) -> dict:
    """Decode tok/s (tokens after the first over the time after it), the whole stream's seconds, and
    the engine core's CPU seconds per output token."""
    meter = CpuMeter(pgid)
    with StreamingClient(grpc_url, model) as client:
        result = client.generate(PROMPT, timeout=600, max_tokens=max_tokens, ignore_eos=True, stream=True)
    meter.stop()
    if result.error is not None:
        raise RuntimeError(result.error)
    cpu = meter.seconds_by_role().get(ENGINE_CORE_ROLE, float("nan"))
    tokens = len(result.token_ids)
    decode_s = result.end_time - result.first_token_time
    return {"decode_tok_s": (tokens - 1) / decode_s, "stream_s": result.end_time - result.start_time,
            "core_cpu_ms_per_token": 1e3 * cpu / tokens, "tokens": tokens}


def policy_environment(name: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICIES[name.removesuffix(FIXED_THREADS)])
    return env


def policy_overrides(name: str) -> dict[str, str]:
    """The config.pbtxt parameters a policy name changes."""
    return {"cpu_adaptive_threads": "false"} if name.endswith(FIXED_THREADS) else {}


def check_policies(names: list[str]) -> None:
    unknown = [name for name in names if name.removesuffix(FIXED_THREADS) not in POLICIES]
    if unknown:
        raise SystemExit(f"--policies: unknown {', '.join(unknown)}; each one of {', '.join(POLICIES)}, "
                         f"optionally with {FIXED_THREADS}")


def round_order(names: list[str], round_index: int) -> list[tuple[str, str]]:
    """(policy, condition) pairs of one round: the policies in turn, reversed every other round, and
    within each the two conditions, also swapped every other round."""
    conditions = ("alone", "busy neighbor") if round_index % 2 == 0 else ("busy neighbor", "alone")
    policies = names if round_index % 2 == 0 else names[::-1]
    return [(name, condition) for name in policies for condition in conditions]


def measure(names: list[str], model_repository: str, max_tokens: int, repeat: int) -> dict[str, dict[str, list[dict]]]:
    """One server per policy, all started first and left idle but for their own streams."""
    results: dict[str, dict[str, list[dict]]] = {name: {"alone": [], "busy neighbor": []} for name in names}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(tritonserver(
            model_repository, policy_overrides(name), extra_args=["--model-control-mode=explicit", "--load-model=llm"],
            env=policy_environment(name), ready_timeout=300)) for name in names}
        for server in servers.values():
            one_stream(server.grpc_url, "llm", 8, server.process.pid)  # warm-up
        for round_index in range(repeat):
            for name, condition in round_order(names, round_index):
                neighbor = start_busy_neighbor() if condition == "busy neighbor" else None
                try:
                    time.sleep(0.5)
                    run = one_stream(servers[name].grpc_url, "llm", max_tokens, servers[name].process.pid)
                finally:
                    if neighbor is not None:
                        neighbor.kill()
                        neighbor.wait()
                results[name][condition].append(run)
                print(f"round {round_index + 1}/{repeat} {name} {condition}: {run['decode_tok_s']:.1f} tok/s, "
                      f"{run['stream_s']:.2f} s, core {run['core_cpu_ms_per_token']:.1f} CPU ms/token", flush=True)
    return results


def table(results: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["| OpenMP wait (+fixed: cpu_adaptive_threads false) | condition | decode tok/s | stream s | engine core CPU ms/token |",
             "| --- | --- | ---: | ---: | ---: |"]
    for policy, runs in results.items():
        for condition, values in runs.items():
            def med(key, values=values):
                return statistics.median(v[key] for v in values)
            lines.append(f"| {policy} | {condition} | {med('decode_tok_s'):.1f} | {med('stream_s'):.2f} | "
                         f"{med('core_cpu_ms_per_token'):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.cpu_contention", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policies", default="default,default+fixed,spin1k+fixed",
                        help=f"of {', '.join(POLICIES)}, each optionally with {FIXED_THREADS}")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "perf" / "results" / "cpu_contention.json")
    args = parser.parse_args(argv)

    check_policies(args.policies.split(","))
    results = measure(args.policies.split(","), args.model_repository, args.max_tokens, args.repeat)
    print("\n" + table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": results, "settings": vars(args) | {"out": str(args.out)},
                                    "git": git_state(), "machine": machine_info(), "when": now_iso()}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
