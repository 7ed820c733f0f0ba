"""The engine thread: takes new requests and aborts, steps while there is work, sleeps otherwise.

Everything that touches the engine (tokenizing, adding, aborting, stepping) happens on this one
thread, so the engine needs no locks. Results go to ``outbox`` as ``(outputs, stats)`` pairs for
the response thread; ``None`` in the outbox means the loop has stopped. No Triton import here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
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
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: PendingRequest) -> None:
        """Queues a request for the engine; raises BusyError beyond max_queue_len waiting."""
        with self._cond:
            if self._stopping:
                raise BusyError(self._shutdown_message)
            waiting = len(self._pending) + self._num_waiting
            if waiting >= self.max_queue_len:
                raise BusyError(
                    f"server busy: {waiting} requests are waiting (max_queue_len={self.max_queue_len}); retry later"
                )
            self._pending.append(request)
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
                outputs: list[RequestOutput] = []
                if stopping:
                    self._fail_everything(pending, outputs)
                    self.outbox.put((outputs, self.engine.stats()))
                    return
                for request in pending:
                    error = self._add(request)
                    if error is not None:
                        outputs.append(error_output(request.request_id, error, request.arrival_time))
                for request_id in aborts:
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        outputs.append(output)
                if self.engine.has_unfinished_requests():
                    outputs.extend(self.engine.step_or_fail_all())
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
                arrival_time=request.arrival_time,
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
