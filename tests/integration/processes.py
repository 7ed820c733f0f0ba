"""Finding the server's processes by their command line, as the tests that kill or count them do."""

from __future__ import annotations

import os
from collections.abc import Iterable

from backend.proc_stat import read_proc_stat


def processes_whose_command_has(*markers: bytes, among: Iterable[int] | None = None) -> list[int]:
    """pids (of ``among``, else of every process) whose command line contains every marker.

    A child that one of them forked and that has not yet run its exec shows the same command line
    (a stub starting its engine core, a core starting its compile worker's fork server): under load
    that window is long enough to be seen, so a match whose parent also matches is left out.
    """
    pids = among if among is not None else (int(name) for name in os.listdir("/proc") if name.isdigit())
    found: dict[int, int] = {}  # pid -> parent pid
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read()
        except OSError:
            continue
        stat = read_proc_stat(pid) if all(marker in command for marker in markers) else None
        if stat is not None:
            found[pid] = stat.ppid
    return [pid for pid, parent in found.items() if parent not in found]


def describe_processes(pids: Iterable[int]) -> str:
    """One line per pid: its parent, state, nice value and command line (for an assertion's message)."""
    lines = []
    for pid in pids:
        stat = read_proc_stat(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            stat = None
        if stat is None:
            lines.append(f"{pid}: gone")
            continue
        lines.append(f"{pid}: parent {stat.ppid}, state {stat.state}, nice {stat.nice}: {command[:200]}")
    return "\n".join(lines)
