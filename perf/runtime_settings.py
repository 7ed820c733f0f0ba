"""Thread binding and allocator settings against our defaults, the engine in-process, alternating.

vLLM's tuned CPU setup binds its OpenMP threads to cores and preloads tcmalloc; this measures
whether either helps our engine here. Each setup is a fresh ``python -m perf.compare --systems
engine`` process (LD_PRELOAD and OMP_* are read at process start, so they go in the child's
environment) on the same seeded workload; the setups run in turn, ``--repeat`` rounds, and the
table gives each one's median. perf.dtype_choice measures its dtypes with the same rounds
(``alternate``).

    .venv/bin/python -m perf.runtime_settings [--setups default,tcmalloc,jemalloc,bind] [--repeat 3] \\
        [-- perf.compare arguments, default: the mixed workload in bfloat16]

Setups: ``default`` (torch's threads, glibc malloc with the mmap/trim thresholds the model runner
raises), ``tcmalloc`` / ``jemalloc`` (LD_PRELOAD of the system library, skipped when absent),
``bind`` (OMP_PROC_BIND=close, OMP_PLACES=cores), ``passive`` (OMP_WAIT_POLICY=PASSIVE: OpenMP's
threads sleep at once at a barrier instead of spinning first, what a machine shared with other
work needs, see perf.cpu_contention), ``spin1k`` (GOMP_SPINCOUNT=1000: a short spin before the
sleep), and ``tcmalloc+bind``. Arguments after ``--`` replace the workload, and may name another
system (``-- --systems triton ...``: the server inherits the setup's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from backend.paths import REPO_ROOT

ALLOCATORS = {
    "tcmalloc": ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"),
    "jemalloc": ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",),
}
BIND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
# OpenMP wait settings by name (libgomp's, which torch's wheels use); perf.cpu_contention uses them too
OPENMP_WAITS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin1k": {"GOMP_SPINCOUNT": "1000"},
                "spin10k": {"GOMP_SPINCOUNT": "10000"}, "spin100k": {"GOMP_SPINCOUNT": "100000"}}
MIXED = ["--num-requests", "64", "--input-len", "uniform:16:512", "--output-len", "uniform:16:256", "--dtype", "bfloat16"]


def engine_throughput(compare_args: list[str], out_dir: Path, env: dict[str, str] | None = None) -> float | None:
    """Output tok/s of ``python -m perf.compare --systems engine`` run in a child process with
    ``compare_args`` (and ``env``, its environment), from its compare.json; None when it failed."""
    report = out_dir / "compare.json"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "perf.compare", "--systems", "engine", *compare_args, "--out-dir", str(out_dir)]
    run = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if run.returncode != 0 or not report.exists():
        print(f"perf.compare exited with {run.returncode}\n{run.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(report.read_text())["results"][0]["output_token_throughput"]


def alternate(setups: dict[str, tuple[list[str], dict[str, str] | None]], repeat: int,
              out_root: Path) -> dict[str, list[float]]:
    """``repeat`` rounds of every setup (its perf.compare arguments, its environment) in turn:
    each setup's output tok/s per round."""
    results: dict[str, list[float]] = {name: [] for name in setups}
    for round_index in range(repeat):
        for name, (compare_args, env) in setups.items():
            value = engine_throughput(compare_args, out_root / name.replace(" ", "_"), env)
            shown = "no result" if value is None else f"{value:.1f} out tok/s"
            print(f"round {round_index + 1}/{repeat} {name}: {shown}", flush=True)
            if value is not None:
                results[name].append(value)
    return results


def setup_environment(name: str) -> dict[str, str] | None:
    """The environment of one setup, or None when its library is not installed here."""
    env = dict(os.environ)
    for part in name.split("+"):
        if part == "default":
            continue
        if part == "bind":
            env.update(BIND)
        elif part in ("passive", "spin1k"):
            env.update(OPENMP_WAITS[part])
        elif part in ALLOCATORS:
            found = next((p for p in ALLOCATORS[part] if os.path.exists(p)), None)
            if found is None:
                return None
            env["LD_PRELOAD"] = found
        else:
            raise ValueError(f"unknown setup part {part!r}")
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare_args = MIXED
    if "--" in argv:
        compare_args = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(prog="python -m perf.runtime_settings", description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="default,tcmalloc,bind")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    setups = {}
    for name in args.setups.split(","):
        env = setup_environment(name)
        if env is None:
            print(f"{name}: its library is not installed here, skipped")
            continue
        setups[name] = (compare_args, env)
    results = alternate(setups, args.repeat, REPO_ROOT / "build" / "runtime_settings")
    base = statistics.median(results["default"]) if results.get("default") else None
    print("\n| setup | out tok/s per round | median | vs default |\n| --- | --- | ---: | ---: |")
    for name, values in results.items():
        if not values:
            continue
        median = statistics.median(values)
        ratio = "-" if base is None else f"{median / base:.3f}x"
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
