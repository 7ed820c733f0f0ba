"""backend/proc_stat.py: the fields of /proc/PID/stat, even behind a command name with ')' and spaces."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from backend.proc_stat import all_pids, read_proc_stat


def test_this_process_reads_as_the_os_module_sees_it():
    stat = read_proc_stat(os.getpid())
    assert stat is not None
    assert (stat.ppid, stat.pgrp, stat.session) == (os.getppid(), os.getpgrp(), os.getsid(0))
    assert stat.nice == os.getpriority(os.PRIO_PROCESS, 0)
    assert stat.state == "R" and not stat.zombie  # it is running: it reads its own stat
    with open("/proc/self/comm") as handle:
        assert stat.comm == handle.read().strip()
    used = os.times()
    assert abs(stat.cpu_seconds - (used.user + used.system)) < 0.05
    assert stat.start_ticks > 0 and os.getpid() in all_pids()


def test_a_command_name_with_a_parenthesis_and_spaces_leaves_the_fields_in_place(tmp_path):
    odd = tmp_path / "x) y (z"  # the kernel takes the executable's name as the command name
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import os, time; os.nice(3); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while (stat := read_proc_stat(child.pid)) is not None and stat.nice != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stat is not None
        assert stat.comm == "x) y (z"
        assert (stat.ppid, stat.pgrp, stat.session, stat.nice) == (os.getpid(), os.getpgrp(), os.getsid(0), 3)
        assert stat.state in ("S", "R")
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while not (stat := read_proc_stat(child.pid)).zombie and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stat.zombie  # killed, not yet reaped
    child.wait()
    assert read_proc_stat(child.pid) is None  # reaped: gone
