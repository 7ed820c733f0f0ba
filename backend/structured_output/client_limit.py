"""Compiles in flight per client: one client cannot fill the compile worker's queue.

A client is ``SamplingParams.user`` ("" for every request naming none, which share one count). A
compile is in flight from the cache miss that started it until its future resolves (compiled,
failed or timed out). A client already at ``structured_output_max_compiles_per_client`` is refused
a constraint that is not compiled or compiling already; a cache hit costs no compile and is never
refused (the manager asks only on a miss).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from backend.protocol.structured_output import StructuredOutputError


class ClientCompileLimit:
    def __init__(self, max_per_client: int):
        """``max_per_client`` 0: no cap."""
        self.max_per_client = max_per_client
        self._in_flight: dict[str, int] = {}  # clients with compiles in flight only
        self._lock = threading.Lock()  # futures resolve on the compile threads

    def in_flight(self, user: str) -> int:
        with self._lock:
            return self._in_flight.get(user, 0)

    def admit(self, user: str, key: str) -> None:
        """Raises StructuredOutputError naming ``key`` and the parameter when ``user`` is at the cap."""
        count = self.in_flight(user)
        if self.max_per_client and count >= self.max_per_client:
            who = f"user {user!r}" if user else "requests naming no user"
            raise StructuredOutputError(
                f"{key}: {count} constraints of {who} are compiling already; at most {self.max_per_client} at once "
                "(parameter structured_output_max_compiles_per_client)")

    def track(self, user: str, future: Future) -> None:
        """Counts ``future`` against ``user`` until it resolves."""
        with self._lock:
            self._in_flight[user] = self._in_flight.get(user, 0) + 1
        future.add_done_callback(lambda _: self._resolved(user))

    def _resolved(self, user: str) -> None:
        with self._lock:
            count = self._in_flight.pop(user) - 1
            if count:
                self._in_flight[user] = count
