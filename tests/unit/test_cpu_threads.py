"""The engine's thread governor (backend/engine/cpu_threads.py): its rules on made-up signals, and on a
real machine, a torch loop's threads cut beside busy processes and given back once they are gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from backend.engine import cpu_threads
from backend.engine.cpu_threads import (
    MAX_HOLD_SECONDS,
    MIN_HOLD_SECONDS,
    STARVED_WINDOWS,
    WINDOW_SECONDS,
    YIELDING_NICE,
    CpuThreadGovernor,
    YieldingHelpers,
    cpu_thread_governor,
    descendant_pids,
    idle_seconds,
    process_schedstat,
)
from perf.cpu_contention import start_busy_neighbor


class Machine:
    """Made-up clock and cumulative /proc counters that a test advances window by window."""

    def __init__(self):
        self.now = 100.0
        self.ran = 0.0
        self.waited = 0.0
        self.idle = 0.0
        self.yielded = 0.0
        self.reads = 0
        self.thread_calls: list[int] = []

    def read_schedstat(self) -> tuple[float, float]:
        self.reads += 1
        return self.ran, self.waited

    def governor(self, full: int = 2) -> CpuThreadGovernor:
        return CpuThreadGovernor(full, self.thread_calls.append, self.read_schedstat, lambda: self.idle,
                                 read_yielded=lambda: self.yielded, clock=lambda: self.now)

    def window(self, governor: CpuThreadGovernor, waited_cores: float, idle_cores: float,
               seconds: float = WINDOW_SECONDS, ran_cores: float | None = None, helper_cores: float = 0.0) -> int:
        """A window in which the engine's threads ran ``ran_cores`` (default: all of them, busy) and
        its low-priority helpers ``helper_cores``."""
        self.now += seconds
        self.ran += (governor.threads if ran_cores is None else ran_cores) * seconds
        self.waited += waited_cores * seconds
        self.idle += idle_cores * seconds
        self.yielded += helper_cores * seconds
        governor.observe()
        return governor.threads

    def starve(self, governor: CpuThreadGovernor, waited_cores: float) -> int:
        """As many starved windows as it takes to cut the threads."""
        for _ in range(STARVED_WINDOWS):
            self.window(governor, waited_cores, idle_cores=0.0)
        return governor.threads


def test_threads_drop_to_one_when_they_wait_a_core_for_the_cpu_and_come_back_once_a_core_is_idle():
    machine = Machine()
    governor = machine.governor()
    assert machine.window(governor, waited_cores=0.1, idle_cores=0.0) == 2  # busy, not starved
    for _ in range(3):  # a starved window between others is a burst, not a neighbor
        assert machine.window(governor, waited_cores=0.98, idle_cores=0.0) == 2
        assert machine.window(governor, waited_cores=0.2, idle_cores=0.0) == 2
    assert machine.starve(governor, waited_cores=0.98) == 1
    assert machine.thread_calls == [1] and governor.reductions == 1
    # Within the hold, an idle core does not bring the threads back.
    assert machine.window(governor, waited_cores=0.0, idle_cores=1.0) == 1
    machine.window(governor, waited_cores=0.0, idle_cores=0.0, seconds=MIN_HOLD_SECONDS)
    assert governor.threads == 1  # the hold is over but the CPUs are still busy
    # An idle engine leaves its CPUs idle whatever its neighbors do: that tells nothing.
    assert machine.window(governor, waited_cores=0.0, idle_cores=1.0, seconds=30, ran_cores=0.05) == 1
    assert machine.window(governor, waited_cores=0.0, idle_cores=0.9) == 2
    assert machine.thread_calls == [1, 2]


def test_the_hold_doubles_while_the_machine_stays_busy_and_resets_after_a_quiet_stretch():
    machine = Machine()
    governor = machine.governor()
    machine.starve(governor, waited_cores=1.0)
    holds = []
    for _ in range(7):  # back after each hold, starved again at once
        machine.window(governor, waited_cores=0.0, idle_cores=1.0, seconds=governor.hold_seconds)
        assert governor.threads == 2
        assert machine.starve(governor, waited_cores=1.0) == 1
        holds.append(governor.hold_seconds)
    assert holds == [min(MIN_HOLD_SECONDS * 2 ** k, MAX_HOLD_SECONDS) for k in range(1, 8)]
    machine.window(governor, waited_cores=0.0, idle_cores=1.0, seconds=governor.hold_seconds)
    machine.window(governor, waited_cores=0.0, idle_cores=0.0, seconds=3 * MAX_HOLD_SECONDS)  # quiet and full
    assert machine.starve(governor, waited_cores=1.0) == 1 and governor.hold_seconds == MIN_HOLD_SECONDS


def test_many_threads_drop_to_the_cores_they_got_not_to_one():
    machine = Machine()
    governor = machine.governor(full=8)
    assert machine.starve(governor, waited_cores=2.2) == 6
    assert machine.starve(governor, waited_cores=0.7) == 5  # still starved: fewer again
    assert machine.starve(governor, waited_cores=9.0) == 1  # never below one


def test_the_engines_own_low_priority_helpers_neither_cut_the_threads_nor_hold_them_back():
    machine = Machine()
    governor = machine.governor()
    for _ in range(4 * STARVED_WINDOWS):  # the wait their CPU explains is not a neighbor's
        assert machine.window(governor, waited_cores=0.7, idle_cores=0.0, helper_cores=0.4) == 2
    assert machine.starve(governor, waited_cores=1.2) == 1  # a neighbor's wait beyond theirs still cuts
    machine.window(governor, waited_cores=0.0, idle_cores=0.1, helper_cores=0.5, seconds=MIN_HOLD_SECONDS)
    assert governor.threads == 2  # the CPU a helper uses is this engine's to take


def test_nothing_is_read_before_a_window_has_passed():
    machine = Machine()
    governor = machine.governor()
    reads = machine.reads
    for _ in range(10):
        machine.now += WINDOW_SECONDS / 20
        governor.observe()
    assert machine.reads == reads


def test_no_governor_where_it_has_nothing_to_do():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_thread_governor(False, "cpu", 1) is None
        assert cpu_thread_governor(True, "cuda", 1) is None
        assert cpu_thread_governor(True, "cpu", 2) is None
        assert cpu_thread_governor(True, "cpu", 1) is not None
        torch.set_num_threads(1)
        assert cpu_thread_governor(True, "cpu", 1) is None
    finally:
        torch.set_num_threads(threads)


def test_the_proc_readers_count_this_process_and_its_cpus():
    cpus = frozenset(os.sched_getaffinity(0))
    ran, waited = process_schedstat()
    assert ran > 0.0 and waited >= 0.0
    before = idle_seconds(cpus)
    time.sleep(0.3)
    assert idle_seconds(cpus) >= before
    assert idle_seconds(frozenset()) == 0.0


def test_yielding_helpers_are_this_processs_children_in_its_session_well_below_its_priority():
    """Busy children: one at YIELDING_NICE below this process (counted), one at its own priority,
    and one at YIELDING_NICE below but in a session (an autogroup) of its own (neither counted)."""
    busy = "import os, sys\nos.nice(int(sys.argv[1]))\nwhile True: pass"
    own = os.getpriority(os.PRIO_PROCESS, 0)
    children = [subprocess.Popen([sys.executable, "-c", busy, str(YIELDING_NICE)]),
                subprocess.Popen([sys.executable, "-c", busy, "0"]),
                subprocess.Popen([sys.executable, "-c", busy, str(YIELDING_NICE)], start_new_session=True)]
    pids = [child.pid for child in children]
    try:
        deadline = time.monotonic() + 10
        while not set(pids) <= set(descendant_pids()):  # what the governor lists: all of them
            assert time.monotonic() < deadline, (pids, descendant_pids())
            time.sleep(0.05)
        # Only these three: other tests of this process may have left niced children of their own.
        helpers = YieldingHelpers(lambda: pids)
        helpers()  # from here on
        time.sleep(1.5)
        counted = helpers()
        assert os.getpriority(os.PRIO_PROCESS, children[0].pid) == own + YIELDING_NICE
        assert 0.05 < counted < 1.5 + 0.1, counted  # one child's CPU, not three children's
        others = YieldingHelpers(lambda: pids[1:])
        others()
        time.sleep(0.5)
        assert others() == 0.0
        children[0].kill()
        children[0].wait()
        assert helpers() >= counted  # a helper's end does not lower the total
    finally:
        for child in children:
            child.kill()
            child.wait()


def run_until(governor: CpuThreadGovernor, done, timeout: float) -> float:
    """Runs matrix products on torch's threads, observing after each few as the engine does after a
    step, until ``done(governor.threads)``; returns the seconds it took."""
    a, w = torch.randn(64, 576), torch.randn(3072, 576)
    start = time.monotonic()
    while not done(governor.threads):
        assert time.monotonic() - start < timeout, f"still {governor.threads} threads after {timeout} s"
        for _ in range(5):
            torch.nn.functional.linear(a, w)
        governor.observe()
    return time.monotonic() - start


def test_a_real_torch_loop_sheds_threads_beside_busy_processes_and_takes_them_back_when_they_end(monkeypatch):
    monkeypatch.setattr(cpu_threads, "MIN_HOLD_SECONDS", 1.0)
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(2, cores))
    neighbors: list[subprocess.Popen] = []
    try:
        governor = cpu_thread_governor(True, "cpu", 1)
        assert governor is not None
        full = governor.full
        # One busy process per core starves the loop with or without autogroup (which gives each
        # session an equal share: then this one gets cores / (cores + 1) of them).
        neighbors = [start_busy_neighbor() for _ in range(cores)]
        run_until(governor, lambda now: now < full, timeout=10)
        assert torch.get_num_threads() == governor.threads < full
        for neighbor in neighbors:
            neighbor.kill()
            neighbor.wait()
        neighbors = []
        run_until(governor, lambda now: now == full, timeout=10)
        assert torch.get_num_threads() == full
    finally:
        for neighbor in neighbors:
            neighbor.kill()
            neighbor.wait()
        torch.set_num_threads(threads)
