"""Per-client fairness: at most ``max_requests_per_client`` requests of one client in flight or waiting.

A client is the ``user`` its requests name (OpenAI's ``user`` field on the front; ``user`` in
``sampling_parameters`` on Triton's gRPC path); requests that name none share one key. A request
counts from its admission until the engine's final output for it, so one client with many streams
cannot take every seat of the batch and the whole queue: its next request is refused as busy, for
that client only, while every other client is still admitted. Used under the admission lock
(backend/engine_core/admission.py); ``release`` comes from whichever thread takes the outputs.
"""

from __future__ import annotations

import threading

SHARED_CLIENT = ""  # the key of requests that name no user


def client_busy_message(client: str, count: int, cap: int) -> str:
    who = f"client {client!r}" if client else "requests that name no user"
    return (f"server busy for {who}: {count} requests in flight or waiting "
            f"(max_requests_per_client={cap}); retry when one has finished")


class ClientCap:
    def __init__(self, max_requests_per_client: int):
        self.cap = max_requests_per_client  # 0: no cap
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._client_of: dict[str, str] = {}  # request id -> its client

    def refusal(self, client: str) -> str | None:
        """The busy message when ``client`` is at its cap; None when it may send one more."""
        if not self.cap:
            return None
        with self._lock:
            count = self._counts.get(client, 0)
        return client_busy_message(client, count, self.cap) if count >= self.cap else None

    def acquire(self, client: str, request_id: str) -> None:
        """Counts an admitted request (after ``refusal`` said yes, under the same admission lock)."""
        if not self.cap:
            return
        with self._lock:
            self._counts[client] = self._counts.get(client, 0) + 1
            self._client_of[request_id] = client

    def release(self, request_id: str) -> None:
        """The request ended (its final output); unknown ids are ignored."""
        if not self.cap:
            return
        with self._lock:
            client = self._client_of.pop(request_id, None)
            if client is None:
                return
            left = self._counts[client] - 1
            if left:
                self._counts[client] = left
            else:
                del self._counts[client]

    def release_all(self) -> None:
        """The engine lost every request at once (its core died): nobody holds a seat now."""
        with self._lock:
            self._counts.clear()
            self._client_of.clear()

    def in_flight(self, client: str) -> int:
        with self._lock:
            return self._counts.get(client, 0)
