"""Inter-token gaps of a free and an already-compiled constrained stream, alone and while slow
JSON schemas arrive (issue 37): ``python -m perf.hostile_schemas [--repeat 3]``.

Each round streams the two alone, then again while three distinct slow schemas (within the default
budget: 32 short patterns among 256 properties) are sent from three clients; rounds alternate so
the machine's drift hits both sides. Reports the medians over rounds of each stream's median and
p99 gap, and what the schemas' clients got (their latency and outcome). Served on a started
tritonserver (demo model by default); ``--set NAME=VALUE`` changes `llm` parameters.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

from backend.models.demo_model import DEMO_REPOSITORY
from backend.paths import REPO_ROOT
from client.stream import StreamingClient
from perf.served import report_dir, tritonserver, write_report

CACHED_CONSTRAINT = {"structured_outputs": {"regex": "[a-z]{2500}"}}


def slow_schema(prefix: str) -> dict:
    """Within the default budget (256 properties, 32 short patterns, 7.5 kB), yet seconds of token-mask
    compiling: 32 bounded-length patterns among 224 optional properties (the tests use it too)."""
    pattern = {"type": "string", "pattern": "^[a-z0-9_]{1,100}$"}
    return {"type": "object", "properties": {f"{prefix}{i}": pattern if i % 8 == 0 else {"type": "integer"}
                                             for i in range(256)}}


def gaps(result) -> list[float]:
    times = result.token_times
    return sorted(b - a for a, b in zip(times, times[1:], strict=False))


def streams(url: str, timeout: float = 300.0, free_tokens: int = 1200) -> tuple[list[threading.Thread], dict]:
    """Starts the free (``free_tokens`` long) and the cached stream; their threads, and the results they fill in."""
    results: dict = {}

    def run(name: str, **options) -> None:
        with StreamingClient(url) as client:
            results[name] = client.generate("A story:", timeout=timeout, stream=True, **options)

    threads = [threading.Thread(target=run, args=("free",), kwargs={"max_tokens": free_tokens, "ignore_eos": True}),
               threading.Thread(target=run, args=("cached",), kwargs={"max_tokens": 800,
                                                                       "sampling_parameters": CACHED_CONSTRAINT})]
    for thread in threads:
        thread.start()
    return threads, results


def hostile_round(url: str, round_number: int) -> tuple[dict, list]:
    threads, results = streams(url)
    time.sleep(0.5)
    outcomes: list = []

    def send(i: int) -> None:
        started = time.monotonic()
        with StreamingClient(url) as client:
            result = client.generate("Fill in:", timeout=120, max_tokens=8, sampling_parameters={
                "structured_outputs": {"json": slow_schema(f"r{round_number}h{i}_")}, "user": f"client{i}"})
        outcomes.append({"seconds": round(time.monotonic() - started, 2), "outcome": result.error or "compiled"})

    senders = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in senders:
        thread.start()
    for thread in senders + threads:
        thread.join(300)
    return results, outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.hostile_schemas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", default=str(DEMO_REPOSITORY))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an `llm` parameter")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    rows: dict[str, list] = {f"{name} {side}": [] for name in ("free", "cached") for side in ("alone", "during")}
    hostile: list = []
    with tritonserver(args.model_repository, overrides or None) as server:
        with StreamingClient(server.grpc_url) as client:  # the cached constraint compiles once
            client.generate("A story:", timeout=60, max_tokens=4, sampling_parameters=CACHED_CONSTRAINT)
        for number in range(args.repeat):
            threads, alone = streams(server.grpc_url)
            for thread in threads:
                thread.join(300)
            during, outcomes = hostile_round(server.grpc_url, number)
            hostile.extend(outcomes)
            for name in ("free", "cached"):
                for side, result in (("alone", alone[name]), ("during", during[name])):
                    values = gaps(result)
                    rows[f"{name} {side}"].append((statistics.median(values), values[int(0.99 * (len(values) - 1))]))
            print(f"round {number + 1}/{args.repeat} done", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    table = {key: {"median_gap_ms": round(statistics.median(m for m, _ in values) * 1e3, 2),
                   "p99_gap_ms": round(statistics.median(p for _, p in values) * 1e3, 2)} for key, values in rows.items()}
    document = {"command": "python -m perf.hostile_schemas " + " ".join(argv if argv is not None else sys.argv[1:]),
                "commit": commit, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "model_repository": args.model_repository, "overrides": overrides, "dtype": "float32 (demo model)",
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
                "gaps": table, "hostile": hostile}
    lines = [f"model repository {args.model_repository}, overrides {overrides or 'none'}, commit {commit}, "
             f"{os.cpu_count()} CPUs, {args.repeat} rounds (medians)", "",
             "| stream | median gap ms | p99 gap ms |", "|---|---|---|"]
    lines += [f"| {key} | {value['median_gap_ms']} | {value['p99_gap_ms']} |" for key, value in table.items()]
    lines += ["", "slow schemas: " + "; ".join(f"{h['seconds']} s: {h['outcome'][:100]}" for h in hostile)]
    write_report(report_dir(args, "hostile_schemas"), "hostile_schemas", document, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
