"""One process's line of /proc/PID/stat (proc(5)), read in one place.

The command name (field 2) sits in parentheses and may itself hold spaces and ')', so the fields
are counted from the last ')'. The launcher, the replica manager, the engine core's parent watch,
the CPU thread governor, the grammar compile worker's CPU limit and the benchmarks' CPU meters all
read their process facts through ``read_proc_stat``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # the unit of utime and stime


@dataclass(frozen=True, slots=True)
class ProcStat:
    comm: str  # the command name, at most 15 characters (field 2)
    state: str  # "R", "S", "D", "Z" (a zombie: exited, not yet reaped), ... (field 3)
    ppid: int  # field 4
    pgrp: int  # the process group (field 5)
    session: int  # field 6
    cpu_seconds: float  # utime + stime (fields 14 and 15)
    nice: int  # field 19
    start_ticks: int  # when it started, in clock ticks after boot (field 22): a pid with it names one process

    @property
    def zombie(self) -> bool:
        return self.state == "Z"


def read_proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s stat line; None when the process is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            line = handle.read()
    except OSError:
        return None
    head, _, tail = line.rpartition(b")")
    fields = tail.split()
    if len(fields) < 20:
        return None
    return ProcStat(comm=head.partition(b"(")[2].decode(errors="replace"), state=fields[0].decode(),
                    ppid=int(fields[1]), pgrp=int(fields[2]), session=int(fields[3]),
                    cpu_seconds=(int(fields[11]) + int(fields[12])) / CLOCK_TICKS, nice=int(fields[16]),
                    start_ticks=int(fields[19]))


def all_pids() -> list[int]:
    """Every process id in /proc (empty without /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(name) for name in names if name.isdigit()]
