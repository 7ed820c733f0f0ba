"""perf.idle_cpu.wait_until_quiet: a served benchmark's timed window starts once the server is quiet."""

from __future__ import annotations

import subprocess
import sys

from perf.idle_cpu import wait_until_quiet


def _group(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_quiet_group_is_not_waited_for():
    process = _group("import time; time.sleep(30)")
    try:
        assert wait_until_quiet(process.pid, window_s=0.3, timeout_s=10) < 2.0
    finally:
        process.kill()
        process.wait()


def test_a_busy_group_is_waited_for_until_it_quiets_down():
    # Busy for about 2 s of wall time, then asleep: the wait covers the busy part and ends after it.
    process = _group("import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end: pass\ntime.sleep(30)")
    try:
        waited = wait_until_quiet(process.pid, window_s=0.3, timeout_s=20)
        assert 1.5 <= waited < 10
    finally:
        process.kill()
        process.wait()


def test_a_group_that_never_quiets_down_is_waited_for_at_most_the_timeout():
    process = _group("while True: pass")
    try:
        waited = wait_until_quiet(process.pid, window_s=0.3, timeout_s=1.5)
        assert 1.5 <= waited < 3
    finally:
        process.kill()
        process.wait()
