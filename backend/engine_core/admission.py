"""Admission control: whether the engine takes a new request now, the one place that decides it.

Every engine client (backend/engine_core/engine_client.py: in a thread, in its own process,
stepping on demand) asks its ``AdmissionControl`` before it queues a request and tells it what the
engine reported after each step. A refusal is a ``BusyError`` whose message is what the client is
told (the Triton models send it as UNAVAILABLE), in this order:

- the model is stopping (``close``): the stop's message;
- the server stops or the model unloads (``begin_drain``): ``DRAINING_MESSAGE``, from then on. The
  grace period given here is handed to the engine core, which ends what still runs when it is
  over (``EngineCore.begin_drain``);
- the engine core is down and being replaced (``engine_down`` until ``engine_up``);
- ``max_queue_len`` requests wait already: the engine's waiting count as of its last report plus
  the requests admitted since that it had not taken yet;
- the request's client has ``max_requests_per_client`` requests in flight or waiting already
  (backend/engine_core/client_cap.py): refused for that client only.

Thread-safe: Triton's thread admits while the engine's reader or loop thread reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from backend.engine_core.client_cap import SHARED_CLIENT, ClientCap

DRAINING_MESSAGE = "shutting down (server stop or model unload): not accepting new requests"
RESTARTING_MESSAGE = "the engine core is restarting after a failure; retry in a few seconds"
UNLOADING_MESSAGE = "the model is being unloaded"


class BusyError(RuntimeError):
    """The engine takes no request now (see the module docstring); the message says why."""


def busy_message(waiting: int, max_queue_len: int) -> str:
    return f"server busy: {waiting} requests are waiting (max_queue_len={max_queue_len}); retry later"


class AdmissionControl:
    def __init__(self, max_queue_len: int, engine_up: bool = True, max_requests_per_client: int = 0):
        self.max_queue_len = max_queue_len
        self.clients = ClientCap(max_requests_per_client)
        self._lock = threading.Lock()
        self._closed: str | None = None  # the stop's message, once the model stops
        self._drain_grace: float | None = None  # set once draining starts
        self._engine_up = engine_up
        self._num_waiting = 0  # the engine's, as of its last report
        self._admitted = 0  # requests admitted since the engine's counts started
        self._taken = 0  # of those, how many the engine had taken at its last report

    def admit(self, on_accept: Callable[[], None] | None = None, client: str = SHARED_CLIENT,
              request_id: str | None = None) -> None:
        """Raises BusyError naming why the request is refused; otherwise ``on_accept()`` runs (under
        the lock, so a stop or a drain cannot come between) and the request counts as waiting, and
        as its client's until ``clients.release(request_id)``."""
        with self._lock:
            refusal = self._refusal() or self.clients.refusal(client)
            if refusal is not None:
                raise BusyError(refusal)
            if on_accept is not None:
                on_accept()
            self._admitted += 1
            if request_id is not None:
                self.clients.acquire(client, request_id)

    def _refusal(self) -> str | None:
        if self._closed is not None:
            return self._closed
        if self._drain_grace is not None:
            return DRAINING_MESSAGE
        if not self._engine_up:
            return RESTARTING_MESSAGE
        waiting = self._num_waiting + self._admitted - self._taken
        if waiting >= self.max_queue_len:
            return busy_message(waiting, self.max_queue_len)
        return None

    def engine_reported(self, num_waiting: int, num_taken: int) -> None:
        """The engine's waiting count after a step, and how many admitted requests it had taken by then."""
        with self._lock:
            self._num_waiting = num_waiting
            self._taken = num_taken

    def engine_down(self) -> None:
        """The engine core is lost: refuse until ``engine_up``."""
        with self._lock:
            self._engine_up = False

    def engine_up(self) -> None:
        """A (new) engine core takes requests; its counts start from zero."""
        with self._lock:
            self._engine_up = True
            self._num_waiting = self._admitted = self._taken = 0

    def begin_drain(self, grace_seconds: float) -> bool:
        """Refuses every new request from now on; True the first time (the caller then hands
        ``grace_seconds`` to the engine core), False after."""
        with self._lock:
            if self._drain_grace is not None:
                return False
            self._drain_grace = grace_seconds
            return True

    @property
    def drain_grace(self) -> float | None:
        """The grace period once draining started; None before."""
        return self._drain_grace

    @property
    def draining(self) -> bool:
        return self._drain_grace is not None

    def close(self, message: str) -> None:
        """The model stops: every request from now on is refused with ``message``."""
        with self._lock:
            self._closed = message

    @property
    def closed_message(self) -> str | None:
        """The stop's message once ``close`` was called; None while the model serves."""
        return self._closed
