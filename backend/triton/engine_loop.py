"""The engine thread: takes new requests and aborts, steps while there is work, sleeps otherwise.

Everything that touches the engine (tokenizing, adding, aborting, stepping) happens on this one
thread, so the engine needs no locks. Results go to ``outbox`` as ``(outputs, stats)`` pairs for
the response thread; ``None`` in the outbox means the loop has stopped. No Triton import here.

Draining (the server is shutting down or the model is being unloaded): new requests are refused
with a BusyError, requests in flight go on until they finish or the grace period ends, and then
the rest end with an error that names the shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from backend.engine import EngineInputError, LLMEngine, RequestOutput
from backend.request import FinishReason, SamplingParams

logger = logging.getLogger(__name__)


class BusyError(RuntimeError):
    """More requests wait than max_queue_len allows."""


@dataclass(slots=True)
class PendingRequest:
    request_id: str
    prompt: str
    sampling_params: SamplingParams
    arrival_time: float
    add_special_tokens: bool = True  # False for a prompt rendered from chat messages


def error_output(request_id: str, message: str, arrival_time: float = 0.0,
                 reason: FinishReason = FinishReason.ERROR) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, new_token_ids=[], text="", finished=True, finish_reason=reason,
        num_prompt_tokens=0, num_output_tokens=0, error=message, arrival_time=arrival_time,
    )


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_queue_len: int):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: deque[PendingRequest] = deque()
        self._aborts: deque[str] = deque()
        self._num_waiting = 0  # engine's waiting count, read without the engine
        self._stopping = False
        self._shutdown_message = "the model is being unloaded"
        self._drain_deadline: float | None = None  # monotonic; set once draining starts
        self._drain_grace = 0.0
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: PendingRequest, on_accept: Callable[[], None] | None = None) -> None:
        """Queues a request for the engine; raises BusyError beyond max_queue_len waiting or while
        draining. ``on_accept`` runs under the loop's lock before the request is queued, so whoever
        answers the request (the responder) knows it before the engine can produce anything for it.
        """
        with self._cond:
            if self._stopping:
                raise BusyError(self._shutdown_message)
            if self._drain_deadline is not None:
                raise BusyError("shutting down (server stop or model unload): not accepting new requests")
            waiting = len(self._pending) + self._num_waiting
            if waiting >= self.max_queue_len:
                raise BusyError(
                    f"server busy: {waiting} requests are waiting (max_queue_len={self.max_queue_len}); retry later"
                )
            if on_accept is not None:
                on_accept()
            self._pending.append(request)
            self._cond.notify()

    def begin_drain(self, grace_seconds: float) -> None:
        """Refuses new requests from now on; requests still running after ``grace_seconds`` end with
        an error naming the shutdown. Idempotent (the first call sets the deadline)."""
        with self._cond:
            if self._drain_deadline is None:
                self._drain_grace = grace_seconds
                self._drain_deadline = time.monotonic() + grace_seconds
                logger.warning("draining: requests in flight get up to %g s to finish", grace_seconds)
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
        try:
            while True:
                with self._cond:
                    while not (self._pending or self._aborts or self._stopping or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    pending, self._pending = self._pending, deque()
                    aborts, self._aborts = self._aborts, deque()
                    stopping = self._stopping
                    deadline = self._drain_deadline
                outputs: list[RequestOutput] = []
                if stopping:
                    self._fail_everything(pending, outputs)
                    self.outbox.put((outputs, self.engine.stats()))
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    message = (f"shutting down (server stop or model unload): the request was ended after "
                               f"the {self._drain_grace:g} s grace period (parameter shutdown_grace_seconds)")
                    outputs.extend(error_output(r.request_id, message, r.arrival_time) for r in pending)
                    pending = deque()
                    outputs.extend(self.engine.fail_all(message))
                for request in pending:
                    error = self._add(request)
                    if error is not None:
                        outputs.append(error_output(request.request_id, error, request.arrival_time))
                for request_id in aborts:
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        outputs.append(output)
                if self.engine.has_unfinished_requests():
                    outputs.extend(self.engine.step_or_fail_all().outputs)
                stats = self.engine.stats()
                with self._cond:
                    self._num_waiting = stats.num_waiting
                if outputs or pending or aborts:
                    self.outbox.put((outputs, stats))
        finally:
            self.outbox.put(None)

    def _add(self, request: PendingRequest) -> str | None:
        """Adds a request to the engine; returns the error message when it is refused."""
        try:
            self.engine.add_request(
                request.request_id, prompt=request.prompt, sampling_params=request.sampling_params,
                arrival_time=request.arrival_time, add_special_tokens=request.add_special_tokens,
                check=False,  # backend/triton made the engine's check before queueing
            )
            return None
        except EngineInputError as exc:
            return str(exc)
        except Exception as exc:  # a tokenizer failure must not kill the loop
            logger.exception("adding request %s failed", request.request_id)
            return f"internal error while adding the request: {exc}"

    def _fail_everything(self, pending: deque[PendingRequest], outputs: list[RequestOutput]) -> None:
        for request in pending:
            outputs.append(error_output(request.request_id, self._shutdown_message, request.arrival_time))
        outputs.extend(self.engine.fail_all(self._shutdown_message))
