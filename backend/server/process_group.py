"""Stopping a process we started together with everything it started (its process group): the one
way the launcher, the replicas, the OpenAI front's process and the benchmarks' peers end a server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from backend.proc_stat import all_pids, read_proc_stat


def stop_process_group(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to ``process``, then SIGKILL to its whole process group after ``timeout`` seconds.

    ``process`` must lead its own group (``start_new_session=True``). Children share the group
    (tritonserver's stubs, vLLM's engine core) and are killed even after a clean exit of the
    leader; returns once none of them is alive (or 10 s after the kill).
    """
    pgid = process.pid
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to go
    while live_processes_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def live_processes_in_group(pgid: int) -> list[int]:
    """pids of process group ``pgid`` that are not zombies (Linux /proc; [] elsewhere).

    Zombies are left out: an orphaned stub is reparented to a PID 1 that may never reap it.
    """
    alive = []
    for pid in all_pids():
        stat = read_proc_stat(pid)
        if stat is not None and stat.pgrp == pgid and not stat.zombie:
            alive.append(pid)
    return alive
