"""CPU the server burns with no traffic: tritonserver plus its Python-backend stubs.

    python -m perf.idle_cpu [--settle 10] [--window 10] [--model-repository DIR]

Starts tritonserver on free ports, waits --settle seconds after it is ready, then sums utime+stime
(/proc/<pid>/stat) over every process of its process group at the start and the end of a
--window-second window with no requests, and prints the CPU used as a percentage of one core
(100% = one core busy the whole window). An idle engine thread that polls instead of blocking shows
up here. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from backend.proc_stat import read_proc_stat
from backend.server.launcher import start_server
from backend.server.process_group import live_processes_in_group
from perf.served import DEFAULT_MODEL_REPOSITORY


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds (0 when it is gone)."""
    stat = read_proc_stat(pid)
    return stat.cpu_seconds if stat is not None else 0.0


def group_cpu_seconds(pgid: int) -> dict[int, float]:
    return {pid: process_cpu_seconds(pid) for pid in live_processes_in_group(pgid)}


def measure_idle_cpu(pgid: int, window_s: float) -> dict:
    """CPU used by the process group over ``window_s`` seconds; processes present at both ends count."""
    before = group_cpu_seconds(pgid)
    start = time.monotonic()
    time.sleep(window_s)
    after = group_cpu_seconds(pgid)
    elapsed = time.monotonic() - start
    used = sum(after[pid] - before.get(pid, 0.0) for pid in after)
    return {"window_s": elapsed, "cpu_s": used, "percent_of_one_core": 100.0 * used / elapsed,
            "num_processes": len(after), "per_process_cpu_s": {str(p): after[p] - before.get(p, 0.0) for p in after}}


def wait_until_quiet(pgid: int, below_cores: float = 0.1, window_s: float = 1.0, timeout_s: float = 60.0) -> float:
    """Waits until the process group uses less than ``below_cores`` of a core over ``window_s``
    (at most ``timeout_s``); returns the seconds waited. A served benchmark calls it between its
    warm-up and its timed window, so work a server still does after it reports ready (our engine
    core's fork server importing xgrammar for the structured-output compile worker, a few CPU
    seconds) is not counted against the requests, as a long-running server would not pay it."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        used = measure_idle_cpu(pgid, window_s)
        if used["cpu_s"] < below_cores * used["window_s"]:
            break
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.idle_cpu", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait after ready (default: %(default)s)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured (default: %(default)s)")
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    server = start_server(args.model_repository, ready_timeout=300)
    try:
        time.sleep(args.settle)
        result = measure_idle_cpu(os.getpgid(server.process.pid), args.window)
    finally:
        server.stop()
    result.update(settle_s=args.settle, model_repository=args.model_repository)
    print(f"idle server CPU: {result['percent_of_one_core']:.2f}% of one core "
          f"({result['cpu_s']:.3f} CPU s over {result['window_s']:.1f} s, {result['num_processes']} processes)")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
