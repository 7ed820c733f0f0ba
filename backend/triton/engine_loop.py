"""The in-thread engine (``engine_process: false``): the engine core's loop on a thread of the stub.

Everything that touches the engine (adding, aborting, stepping) happens on this one thread, so the
engine needs no locks; the loop body is ``EngineCore.iterate`` (backend/engine_core/core.py), the
same one the engine-core process runs. Results go to ``outbox`` as ``(outputs, stats)`` pairs for
the response thread; ``None`` in the outbox means the loop has stopped. No Triton import here.
``EngineCoreClient`` (backend/engine_core/client.py) has the same interface for the core process.

Draining (the server is shutting down or the model is being unloaded): new requests are refused
with a BusyError, requests in flight go on until they finish or the grace period ends, and then
the rest end with an error that names the shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

from backend.engine.llm_engine import LLMEngine
from backend.engine_core.core import DRAINING_MESSAGE, BusyError, EngineCore, busy_message
from backend.engine_core.messages import AddRequest

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_queue_len: int):
        self.core = EngineCore(engine)
        self.max_queue_len = max_queue_len
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: deque[AddRequest] = deque()
        self._aborts: deque[str] = deque()
        self._num_waiting = 0  # engine's waiting count, read without the engine
        self._stopping = False
        self._shutdown_message = "the model is being unloaded"
        self._drain_grace: float | None = None  # set once draining starts
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: AddRequest, on_accept: Callable[[], None] | None = None) -> None:
        """Queues a request for the engine; raises BusyError beyond max_queue_len waiting or while
        draining. ``on_accept`` runs under the loop's lock before the request is queued, so whoever
        answers the request (the responder) knows it before the engine can produce anything for it.
        """
        with self._cond:
            if self._stopping:
                raise BusyError(self._shutdown_message)
            if self._drain_grace is not None:
                raise BusyError(DRAINING_MESSAGE)
            waiting = len(self._pending) + self._num_waiting
            if waiting >= self.max_queue_len:
                raise BusyError(busy_message(waiting, self.max_queue_len))
            if on_accept is not None:
                on_accept()
            self._pending.append(request)
            self._cond.notify()

    def flush(self) -> None:
        """Nothing to do: ``submit`` already woke the loop (EngineCoreClient batches here)."""

    def begin_drain(self, grace_seconds: float) -> None:
        """Refuses new requests from now on; requests still running after ``grace_seconds`` end with
        an error naming the shutdown. Idempotent (the first call sets the deadline)."""
        with self._cond:
            if self._drain_grace is None:
                self._drain_grace = grace_seconds
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def stop(self, timeout: float = 30.0, message: str | None = None) -> None:
        """Ends the loop: every unfinished request gets an error output, then ``None`` is posted."""
        with self._cond:
            self._stopping = True
            if message:
                self._shutdown_message = message
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._cond:
                    while not (self._pending or self._aborts or self._stopping or core.has_work()
                               or (self._drain_grace is not None and not core.draining)):
                        self._cond.wait()
                    pending, self._pending = list(self._pending), deque()
                    aborts, self._aborts = list(self._aborts), deque()
                    stopping = self._stopping
                    drain_grace = self._drain_grace
                if stopping:
                    self.outbox.put((core.fail_everything(self._shutdown_message, pending), core.stats()))
                    core.engine.close()  # the offload tier writes what it has queued
                    return
                if drain_grace is not None:
                    core.begin_drain(drain_grace)
                outputs = core.iterate(pending, aborts)
                stats = core.stats()
                with self._cond:
                    self._num_waiting = stats.num_waiting
                if outputs or pending or aborts:
                    self.outbox.put((outputs, stats))
        finally:
            self.outbox.put(None)
