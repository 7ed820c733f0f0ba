"""CPU seconds a system used during a run: its server's processes, one by one, and this (client) process.

On a machine with few cores the load generator, the server's front end and the engine compete for
the same cores, so throughput alone hides where the time went. perf.compare records, per system,
the CPU time of every process of the server's process group (tritonserver, each model's Python
stub and engine-core process; vLLM's API server and engine core) under a role name
(``process_role``), and of this process (the client threads, or the whole system when it runs
in-process), so the table can show CPU ms per output token for each process next to tokens per
second.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from backend.proc_stat import read_proc_stat
from perf.idle_cpu import group_cpu_seconds

CLIENT_ROLE = "client"
_INSTANCE_SUFFIX = re.compile(r"_\d+_\d+$")  # the stub's instance argument: llm_0_0 -> llm


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    stat = read_proc_stat(pid)
    return stat.ppid if stat is not None else None


def process_role(pid: int) -> str:
    """What a server process is: ``tritonserver``, ``stub <model>`` (a Python-backend stub, named by
    its model instance), ``engine core <model>`` (our core process, named by the stub that started
    it), ``vllm engine core``, ``vllm api server``, else the program's name."""
    args = [a for a in _cmdline(pid) if a]
    if not args:
        return f"pid {pid}"
    program = Path(args[0]).name
    if program == "tritonserver":
        return "tritonserver"
    if program == "triton_python_backend_stub":
        instances = [a for a in args[1:] if _INSTANCE_SUFFIX.search(a)]  # llm_0_0 (after model.py, shm, sizes)
        return f"stub {_INSTANCE_SUFFIX.sub('', instances[-1]) if instances else '?'}"
    if "backend.engine_core.core_process" in args:
        parent = _parent(pid)
        stub = process_role(parent) if parent else "stub ?"
        return "engine core " + stub.removeprefix("stub ")
    joined = " ".join(args)
    if "vllm.entrypoints" in joined:
        return "vllm api server"
    stat = read_proc_stat(pid)
    comm = stat.comm if stat is not None else program
    if comm.lower().startswith("vllm::"):
        return "vllm engine core"
    return comm or program


class CpuMeter:
    """Starts measuring at construction; ``stop()`` ends the window."""

    def __init__(self, server_pgid: int | None):
        self.server_pgid = server_pgid
        self._server_start = group_cpu_seconds(server_pgid) if server_pgid is not None else {}
        self._client_start = time.process_time()
        self._server_end: dict[int, float] = {}
        self._roles: dict[int, str] = {}
        self._client_end: float | None = None

    def stop(self) -> None:
        self._client_end = time.process_time()
        if self.server_pgid is not None:
            self._server_end = group_cpu_seconds(self.server_pgid)
            self._roles = {pid: process_role(pid) for pid in self._server_end}

    def client_seconds(self) -> float:
        """CPU time of this process (all its threads) over the window."""
        end = self._client_end if self._client_end is not None else time.process_time()
        return end - self._client_start

    def server_seconds(self) -> float | None:
        """CPU time of the server's process group over the window (processes started in it count fully)."""
        if self.server_pgid is None:
            return None
        return sum(end - self._server_start.get(pid, 0.0) for pid, end in self._server_end.items())

    def seconds_by_role(self) -> dict[str, float]:
        """CPU seconds over the window per process role (``process_role``), the client included."""
        by_role: dict[str, float] = {}
        for pid, end in self._server_end.items():
            role = self._roles.get(pid, f"pid {pid}")
            by_role[role] = by_role.get(role, 0.0) + end - self._server_start.get(pid, 0.0)
        by_role[CLIENT_ROLE] = self.client_seconds()
        return by_role
