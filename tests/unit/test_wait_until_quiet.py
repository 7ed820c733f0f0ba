"""perf.idle_cpu.wait_until_quiet: a served benchmark's timed window starts once the server is quiet."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

from perf.idle_cpu import wait_until_quiet


@contextlib.contextmanager
def process_group(code: str) -> Iterator[int]:
    """A Python process running ``code`` in a group of its own; yields the group id; killed on exit."""
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_a_quiet_group_is_not_waited_for():
    with process_group("import time; time.sleep(30)") as pgid:
        assert wait_until_quiet(pgid, window_s=0.3, timeout_s=10) < 2.0


def test_a_busy_group_is_waited_for_until_it_quiets_down():
    # Busy for about 2 s of wall time, then asleep: the wait covers the busy part and ends after it.
    with process_group("import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end: pass\n"
                       "time.sleep(30)") as pgid:
        assert 1.5 <= wait_until_quiet(pgid, window_s=0.3, timeout_s=20) < 10


def test_a_group_that_never_quiets_down_is_waited_for_at_most_the_timeout():
    with process_group("while True: pass") as pgid:
        assert 1.5 <= wait_until_quiet(pgid, window_s=0.3, timeout_s=1.5) < 3
