"""Fewer torch threads while other processes hold this engine's CPUs, all of them again once a core is free.

Why: the step's OpenMP threads meet at a barrier after every parallel loop, and a thread that
arrives first spins before it sleeps (libgomp's default). When another process takes one of the
cores (on Linux with autogroup, one busy process in another session is enough to leave ours half
the CPUs), the threads outnumber the cores left: the one that spins burns the time slice that the
one it waits for needs, and a served stream runs about 30x slower (perf.cpu_contention). With as
many threads as cores actually left, nobody waits at a barrier for a thread that is not running.

Two signals, read after a step once a window of ``WINDOW_SECONDS`` has passed:

* starved: this process's threads waited in the run queue for at least ``STARVED_CORES`` cores'
  worth of each of ``STARVED_WINDOWS`` windows in a row (the second field of
  ``/proc/self/task/*/schedstat``; one window could be a burst of the server's own work). The
  threads drop to the cores they got: the current count less the cores' worth they waited, at
  least one.
* free: while the engine kept its threads running (``BUSY_FRACTION`` of the window each, from the
  first field of schedstat: an idle engine says nothing about its neighbors), the CPUs this process
  may run on were idle for at least ``FREE_CORES`` cores' worth of it (``/proc/stat``). Every
  thread comes back, after a hold that starts at ``MIN_HOLD_SECONDS``
  and doubles (to ``MAX_HOLD_SECONDS``) each time the threads are starved again soon after coming
  back, so a machine that stays busy costs one slow window per hold, not one per window.

This engine's own low-priority helpers (the grammar compile worker: processes it started, in its
session, at least ``YIELDING_NICE`` nice levels below it) are not neighbors: within a session the
scheduler gives them a tenth of a thread's share or less, so they slow a step by their share and
never stall a barrier for a time slice. Their CPU time is taken off the wait and counted as free;
without that, a few seconds of hostile grammar compiles cut the threads and doubled the ITL of
every stream (tests/integration/test_structured_output.py, the hostile schemas).

Off with the config.pbtxt parameter ``cpu_adaptive_threads: false`` (its threads then stay fixed),
on a GPU, across tensor-parallel ranks (each rank keeps its share), and with one thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.proc_stat import CLOCK_TICKS, read_proc_stat

logger = logging.getLogger(__name__)

WINDOW_SECONDS = 0.5
STARVED_CORES = 0.5  # run-queue wait per second of the window, summed over this process's threads
STARVED_WINDOWS = 2  # starved windows in a row before the threads are cut
FREE_CORES = 0.5  # idle time per second of the window, summed over the CPUs this process may use
BUSY_FRACTION = 0.75  # run time per second of the window and thread, for the window to tell a free core
MIN_HOLD_SECONDS = 2.0
MAX_HOLD_SECONDS = 60.0
YIELDING_NICE = 10  # nice levels below this process's at which a helper of its own yields it the CPU


def process_schedstat(task_dir: str = "/proc/self/task") -> tuple[float, float]:
    """Seconds this process's threads (live ones) have run, and waited in the run queue, since they started."""
    ran_ns = waited_ns = 0
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/schedstat") as handle:
                ran, waited = handle.read().split()[:2]
            ran_ns, waited_ns = ran_ns + int(ran), waited_ns + int(waited)
        except (OSError, ValueError):  # the thread ended, or no schedstats in this kernel
            continue
    return ran_ns / 1e9, waited_ns / 1e9


def idle_seconds(cpus: frozenset[int], stat_path: str = "/proc/stat") -> float:
    """Seconds ``cpus`` have been idle (idle + iowait) since boot, summed."""
    total = 0
    with open(stat_path) as handle:
        for line in handle:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                total += int(fields[3]) + int(fields[4])
    return total / CLOCK_TICKS


def child_pids(pid: int | str = "self") -> list[int]:
    """The processes started by any thread of ``pid`` (``/proc/PID/task/*/children``)."""
    children = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # it ended
        return children
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                children.extend(int(child) for child in handle.read().split())
        except (OSError, ValueError):
            continue
    return children


def descendant_pids() -> list[int]:
    found, todo = [], child_pids()
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(child_pids(pid))
    return found


class YieldingHelpers:
    """CPU seconds that this process's yielding helpers (see the module docstring) have used since
    the first call: a running total over the live ones, which a helper's end does not lower."""

    def __init__(self, list_pids: Callable[[], list[int]] = descendant_pids):
        self._list_pids = list_pids
        self._session = os.getsid(0)
        self._nice = os.getpriority(os.PRIO_PROCESS, 0)
        self._seen: dict[int, float] = {}
        self.total = 0.0

    def __call__(self) -> float:
        seen = {}
        for pid in self._list_pids():
            stat = read_proc_stat(pid)
            if stat is None:  # it ended
                continue
            if stat.session != self._session or stat.nice < self._nice + YIELDING_NICE:
                continue
            seen[pid] = stat.cpu_seconds
            self.total += max(0.0, seen[pid] - self._seen.get(pid, 0.0))
        self._seen = seen
        return self.total


@dataclass
class Sample:
    at: float  # time.monotonic()
    ran: float  # process_schedstat()
    waited: float
    idle: float  # idle_seconds() of the process's CPUs
    yielded: float  # YieldingHelpers(): CPU seconds of this engine's low-priority helpers


class CpuThreadGovernor:
    """Sets torch's thread count between 1 and ``full`` from the two signals of the module docstring.

    ``set_threads``, ``read_schedstat``, ``read_idle``, ``read_yielded`` and ``clock`` are
    torch.set_num_threads and the /proc readers above unless a test gives its own."""

    def __init__(self, full: int, set_threads: Callable[[int], None],
                 read_schedstat: Callable[[], tuple[float, float]], read_idle: Callable[[], float],
                 read_yielded: Callable[[], float] = lambda: 0.0, clock: Callable[[], float] = time.monotonic):
        self.full = full
        self.threads = full
        self.reductions = 0  # times the threads were cut for want of CPU
        self.hold_seconds = MIN_HOLD_SECONDS
        self._starved_windows = 0
        self._set_threads, self._read_schedstat, self._read_idle = set_threads, read_schedstat, read_idle
        self._read_yielded = read_yielded
        self._clock = clock
        self._changed_at = clock()
        self._last = self._sample()

    def _sample(self) -> Sample:
        return Sample(self._clock(), *self._read_schedstat(), self._read_idle(), self._read_yielded())

    def observe(self) -> None:
        """After a step: nothing until a window has passed; then at most one change of thread count."""
        now = self._clock()
        if now - self._last.at < WINDOW_SECONDS:
            return
        sample = self._sample()
        elapsed = sample.at - self._last.at
        ran_cores = (sample.ran - self._last.ran) / elapsed
        yielded_cores = (sample.yielded - self._last.yielded) / elapsed
        waited_cores = max(0.0, (sample.waited - self._last.waited) / elapsed - yielded_cores)
        idle_cores = (sample.idle - self._last.idle) / elapsed + yielded_cores
        self._last = sample
        self._starved_windows = self._starved_windows + 1 if waited_cores >= STARVED_CORES else 0
        if self._starved_windows >= STARVED_WINDOWS and self.threads > 1:
            self._starved_windows = 0
            self._reduce(now, waited_cores)
        elif (self.threads < self.full and ran_cores >= BUSY_FRACTION * self.threads and idle_cores >= FREE_CORES
              and now - self._changed_at >= self.hold_seconds):
            self._change(self.full, now)
            logger.info("engine threads back to %d: %.2f of this process's CPUs were idle (or its own "
                        "low-priority helpers')", self.full, idle_cores)

    def _reduce(self, now: float, waited_cores: float) -> None:
        if self.threads == self.full and self.reductions:  # starved again after coming back
            soon = now - self._changed_at < 2 * self.hold_seconds
            self.hold_seconds = min(2 * self.hold_seconds, MAX_HOLD_SECONDS) if soon else MIN_HOLD_SECONDS
        threads = max(1, int(self.threads - waited_cores + 0.5))
        self.reductions += 1
        logger.warning("engine threads %d -> %d for %.0f s at least: they waited %.2f cores' worth for a CPU "
                       "(another process is using this machine's cores; parameter cpu_adaptive_threads)",
                       self.threads, threads, self.hold_seconds, waited_cores)
        self._change(threads, now)

    def _change(self, threads: int, now: float) -> None:
        self._set_threads(threads)
        self.threads = threads
        self._changed_at = now


def cpu_thread_governor(enabled: bool, device_type: str, tensor_parallel_size: int) -> CpuThreadGovernor | None:
    """The governor of this process's torch threads, or None where it has nothing to do (see the
    module docstring) or this system has no per-thread schedstats."""
    full = torch.get_num_threads()
    if not enabled or device_type != "cpu" or tensor_parallel_size > 1 or full < 2:
        return None
    cpus = frozenset(os.sched_getaffinity(0))
    try:  # its first sample reads both /proc sources
        return CpuThreadGovernor(full, torch.set_num_threads, process_schedstat, lambda: idle_seconds(cpus),
                                 YieldingHelpers())
    except (OSError, ValueError, IndexError):
        logger.info("no /proc schedstats here: the engine's thread count stays fixed")
        return None
