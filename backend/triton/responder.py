"""The `llm` response thread: turns engine outputs into Triton responses and watches for cancellation.

Each request gets its text deltas (``stream=true``) or one response with all its text, and exactly
one FINAL flag: after its last token, after an error, and after a cancellation too
(backend/triton/response_state.py has the rules). Coalescing (config.pbtxt ``response_coalescing``,
on by default): each time the thread wakes it takes every iteration waiting in the engine's outbox,
collects them all, then flushes each request they touched once, so the tokens of several steps
that waited for the same request leave in one response. At low load one iteration waits at a time
and nothing changes; under load the responses per request fall by themselves. Metrics are taken
per iteration, at the time this process had it, before any coalescing. With coalescing off the
thread flushes after every output. Cancelled requests (the client cancelled the gRPC call or
closed the stream) are aborted in the engine so their KV blocks are freed at once; the thread asks
Triton every 0.1 s, at most MAX_CANCEL_CHECKS_PER_POLL requests a time (each ask is a round trip
to tritonserver), so with many streams a cancellation is seen within ceil(streams / 8) x 0.1 s.
Once a request is registered, only this thread touches its sender, and never after its FINAL flag.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from backend.engine_core.admission import UNLOADING_MESSAGE
from backend.engine_core.engine_client import EngineClient, EngineOutputs
from backend.protocol.outputs import RequestOutput
from backend.triton.helpers import send_error
from backend.triton.metrics import TritonMetrics
from backend.triton.response_state import ResponseState

logger = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.1  # how often Triton is asked about cancellations (`llm_iterative`'s watcher too)
# Each is_cancelled() is a round trip to tritonserver: a poll asks at most this many requests, the
# ones asked longest ago first, so with many streams each is asked less often (every
# ceil(active / MAX_CANCEL_CHECKS_PER_POLL) polls) instead of the checks eating the send path's CPU.
MAX_CANCEL_CHECKS_PER_POLL = 8


@dataclass(slots=True)
class ActiveRequest:
    """A request the responder answers: where its responses go, and what it has been sent."""

    state: ResponseState
    sender: object  # pb_utils.InferenceResponseSender
    cancel_checked_at: float = 0.0  # when the responder last asked Triton whether it was cancelled

    @property
    def request_id(self) -> str:
        return self.state.request_id


class Responder:
    def __init__(self, pb_utils, engine: EngineClient, metrics: TritonMetrics | None, tokenizer=None,
                 coalesce: bool = True):
        self.pb = pb_utils
        self.coalesce = coalesce
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = tokenizer  # decodes the tokens of vLLM-style logprobs
        self._active: dict[str, ActiveRequest] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="llm-responder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def register(self, active: ActiveRequest) -> None:
        with self._lock:
            self._active[active.request_id] = active

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._active.pop(request_id, None)

    # ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_poll = time.monotonic() + CANCEL_POLL_SECONDS
        while True:
            try:
                items = [self.engine.outbox.get(timeout=CANCEL_POLL_SECONDS)]
            except queue.Empty:
                items = []
            if self.coalesce and items and items[-1] is not None:
                items.extend(self._take_waiting())
            stopped = bool(items) and items[-1] is None
            self._answer([item for item in items if item is not None])
            if stopped:
                self._fail_remaining(UNLOADING_MESSAGE)
                return
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + CANCEL_POLL_SECONDS

    def _take_waiting(self) -> list[EngineOutputs | None]:
        """Every item already in the outbox, up to and including the stop sentinel."""
        waiting = []
        while True:
            try:
                item = self.engine.outbox.get_nowait()
            except queue.Empty:
                return waiting
            waiting.append(item)
            if item is None:
                return waiting

    def _answer(self, items: list[EngineOutputs]) -> None:
        """Collects the items' outputs in order, then flushes each request they touched: once at the
        end when coalescing, else after each of its outputs."""
        touched: dict[str, ActiveRequest] = {}
        for outputs, stats, received_at in items:
            for output in outputs:
                try:
                    active = self._collect(output, received_at)
                except Exception:
                    logger.exception("collecting an output for %s failed", output.request_id)
                    continue
                if active is None:
                    continue
                if self.coalesce:
                    touched[active.request_id] = active
                else:
                    self._flush(active)
            if self.metrics is not None:
                self.metrics.update_engine_stats(stats)
        for active in touched.values():
            self._flush(active)

    def _poll_cancellations(self) -> None:
        with self._lock:
            candidates = [a for a in self._active.values() if not a.state.cancelled]
        if len(candidates) > MAX_CANCEL_CHECKS_PER_POLL:
            candidates.sort(key=lambda a: a.cancel_checked_at)
            del candidates[MAX_CANCEL_CHECKS_PER_POLL:]
        now = time.monotonic()
        for active in candidates:
            active.cancel_checked_at = now
            try:
                cancelled = active.sender.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                active.state.cancelled = True
                self.engine.abort(active.request_id)

    def _collect(self, output: RequestOutput, received_at: float) -> ActiveRequest | None:
        with self._lock:
            active = self._active.get(output.request_id)
        if active is None:
            return None
        active.state.collect(output, received_at, self.metrics)
        if output.finished:
            self.unregister(active.request_id)
        return active

    def _flush(self, active: ActiveRequest) -> None:
        try:
            active.state.flush(self.pb, active.sender, self.tokenizer)
        except Exception:
            logger.exception("sending a response for %s failed", active.request_id)

    def _fail_remaining(self, message: str) -> None:
        with self._lock:
            remaining = list(self._active.values())
            self._active.clear()
        for active in remaining:
            try:
                if active.state.cancelled:
                    active.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    send_error(self.pb, active.sender, message)
            except Exception:
                logger.exception("closing %s failed", active.request_id)
