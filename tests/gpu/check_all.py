#!/usr/bin/env python3
"""Runs every GPU check of the cupy attention backend in a few minutes, for a lent GPU machine.

    python3 tests/gpu/check_all.py [--out DIR] [-- extra pytest arguments]

What it runs (tests/gpu, each also runnable alone with pytest):
  * the kernels through CuPy against the torch reference: every CPU-emulation batch, every
    compiled (dtype, head size), 64 long sequences, offsets past 2^31 elements, side streams;
  * end-to-end greedy parity of attention_backend=cupy with attention_backend=torch;
  * the LoRA decode-rows kernels (kernels/lora_bgmv.cu) against the per-adapter torch path;
  * the decode microbenchmark: achieved bandwidth as a fraction of the device's peak.
Prints the device, CuPy and NVRTC versions first and pytest's report after; writes the whole log
to DIR/gpu_check.log (default perf/results/tmp). Exit status: pytest's, or 2 when this machine
cannot run the backend (the reason is printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def describe_machine() -> tuple[bool, str]:
    import torch

    from backend.attention.cupy_backend import cupy_available

    ok, reason = cupy_available()
    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}", f"cupy backend: {reason}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"device: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
            f"{props.multi_processor_count} SMs"
        )
    return ok, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "perf" / "results" / "tmp")
    parser.add_argument("--timeout", type=int, default=540, help="seconds for the whole pytest run")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)

    ok, description = describe_machine()
    print(description, flush=True)
    if not ok:
        print("no GPU checks can run here", flush=True)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "gpu_check.log"
    env = dict(
        os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1"
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-q",
        "-rA",
        "--durations=10",
        "-p",
        "no:cacheprovider",
        *args.pytest_args,
    ]
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(description + "\n")
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        timer = threading.Timer(args.timeout, proc.kill)  # a hung kernel must not eat the lease
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
        timed_out = not timer.is_alive()
        timer.cancel()
        if timed_out:
            print(f"gpu_check: killed after {args.timeout} s", flush=True)
            code = 124
    print(f"gpu_check: exit {code} after {time.monotonic() - start:.0f} s; log in {log_path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
