"""CPU seconds a system used during a run: its server's process group, and this (client) process.

On a machine with few cores the load generator, the server's front end and the engine compete for
the same cores, so throughput alone hides where the time went. perf.compare records, per system,
the CPU time of the server's whole process group (tritonserver and its Python stubs; vLLM's API
server and engine core) and of this process (the client threads, or the whole system when it runs
in-process), so the table can show output tokens per CPU second next to tokens per second.
"""

from __future__ import annotations

import time

from perf.idle_cpu import group_cpu_seconds


class CpuMeter:
    """Starts measuring at construction; ``stop()`` ends the window."""

    def __init__(self, server_pgid: int | None):
        self.server_pgid = server_pgid
        self._server_start = group_cpu_seconds(server_pgid) if server_pgid is not None else {}
        self._client_start = time.process_time()
        self._server_end: dict[int, float] = {}
        self._client_end: float | None = None

    def stop(self) -> None:
        self._client_end = time.process_time()
        if self.server_pgid is not None:
            self._server_end = group_cpu_seconds(self.server_pgid)

    def client_seconds(self) -> float:
        """CPU time of this process (all its threads) over the window."""
        end = self._client_end if self._client_end is not None else time.process_time()
        return end - self._client_start

    def server_seconds(self) -> float | None:
        """CPU time of the server's process group over the window (processes started in it count fully)."""
        if self.server_pgid is None:
            return None
        return sum(end - self._server_start.get(pid, 0.0) for pid, end in self._server_end.items())
