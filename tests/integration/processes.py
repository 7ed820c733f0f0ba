"""Finding the server's processes by their command line, as the tests that kill or count them do."""

from __future__ import annotations

import os
from collections.abc import Iterable


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
            if all(marker in command for marker in markers):
                with open(f"/proc/{pid}/stat") as handle:
                    found[pid] = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return [pid for pid, parent in found.items() if parent not in found]


def describe_processes(pids: Iterable[int]) -> str:
    """One line per pid: its parent, state, nice value and command line (for an assertion's message)."""
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            lines.append(f"{pid}: gone")
            continue
        lines.append(f"{pid}: parent {fields[1]}, state {fields[0]}, nice {fields[16]}: {command[:200]}")
    return "\n".join(lines)
