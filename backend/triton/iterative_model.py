"""The `llm_iterative` model: Triton's sequence batcher (``iterative_sequence: true``) drives the engine.

The client sends one request; Triton turns it into a sequence and hands it to execute() again and
again until it is released without the RESCHEDULE flag. Each execute() does, on the calling thread:

1. new sequences (first sight of a correlation id) are admitted as `llm` admits its requests
   (backend/triton/admission.py); a refused one gets an error response + FINAL and is not
   rescheduled;
2. cancelled sequences are aborted in the engine (their KV blocks are freed at once);
3. one engine iteration (adds, aborts, one step: the step-on-demand client's ``flush``,
   backend/engine_core/step_on_demand.py) -- the engine still owns the token budget and KV
   admission, so a sequence it cannot advance this iteration gets no response and is simply
   rescheduled;
4. each sequence present gets one response with everything produced for it since its last
   response (FINAL when it ended), and the unfinished ones are rescheduled before returning.

The engine schedules all its requests, not only the ones in this batch (with the `oldest` strategy
Triton may hold some back): outputs of absent sequences are buffered until they come back.
The engine core runs in its own process by default (``engine_process: true``; it steps only when
an iteration asks); with ``engine_process: false`` it runs in this process. Either way one
dedicated thread makes the calls and execute() waits for it: torch on the stub's main thread is
many times slower per decode step than on a worker thread (perf/RESULTS.md). Responses follow the
same rules as `llm`'s (backend/triton/response_state.py), flushed once per execute().
Traps of Triton 2.51 (docs/architecture.md): null requests (correlation id 0) fill empty slots of
the `direct` strategy and are skipped; rescheduling only works before execute() returns; Triton's
own success counters count iterations, so request-level metrics come from here.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from backend.engine_core.admission import UNLOADING_MESSAGE
from backend.engine_core.engine_client import empty_stats
from backend.engine_core.step_on_demand import CoreLost, StepOnDemandClient
from backend.protocol.outputs import RequestOutput
from backend.triton.admission import RequestAdmission
from backend.triton.client_priority import DEFAULT_PRIORITY_RANGE, ClientPriorityRange
from backend.triton.engine_model import EngineModel
from backend.triton.periodic import PeriodicThread
from backend.triton.responder import CANCEL_POLL_SECONDS  # the watcher looks for cancels as often as `llm`'s
from backend.triton.response_state import ResponseState

logger = logging.getLogger(__name__)

# A sequence Triton stopped handing us (its client vanished without a cancel) is aborted after this.
ABANDONED_SECONDS = 600.0


@dataclass(slots=True)
class Sequence:
    """One client request across its iterations: its response state and where it was last seen."""

    state: ResponseState
    last_seen: float = 0.0
    last_request: object = None
    last_sender: object = None

    @property
    def request_id(self) -> str:
        return self.state.request_id


class IterativeDriver:
    """The per-execute() logic, with Triton's pb_utils and the engine passed in (unit-testable).

    ``engine`` is the step-on-demand client (backend/engine_core/step_on_demand.py: its core in
    this process or in its own; its admission control decides busy and drain); ``inputs`` checks,
    renders and tokenizes requests (backend/engine/input_processor.py). Every method runs on the
    one thread that owns the engine (the model's worker thread), the cancellation reaper included:
    no lock.
    """

    def __init__(self, pb, engine: StepOnDemandClient, inputs, model_name: str,
                 metrics=None, max_prompt_bytes: int | None = None, stream_interval: int = 1,
                 priorities: ClientPriorityRange = DEFAULT_PRIORITY_RANGE):
        self.pb = pb
        self.engine = engine
        self.inputs = inputs
        self.model_name = model_name
        self.metrics = metrics
        self.admission = RequestAdmission(pb, engine, inputs, max_prompt_bytes, stream_interval,
                                          priorities)
        self.sequences: dict[object, Sequence] = {}  # correlation id -> sequence
        self._by_request_id: dict[str, object] = {}  # engine request id -> correlation id

    # ------------------------------------------------------------------------------------------
    def execute(self, requests) -> None:
        now = time.monotonic()
        present: dict[object, tuple[object, object]] = {}  # correlation id -> (request, sender)
        for request in requests:
            correlation_id = request.correlation_id()
            if not correlation_id:
                continue  # a null request filling an empty slot of the `direct` strategy
            sender = request.get_response_sender()
            sequence = self.sequences.get(correlation_id)
            if sequence is None:
                if self.admission.admit(request, sender, f"{self.model_name}-{correlation_id}", now,
                                        on_accept=functools.partial(self._track, correlation_id)) is None:
                    continue  # refused: error + FINAL sent, not rescheduled
                sequence = self.sequences[correlation_id]
            sequence.last_seen = now
            sequence.last_request, sequence.last_sender = request, sender
            present[correlation_id] = (request, sender)
            if not sequence.state.cancelled and sequence.state.final is None and _is_cancelled(request, sender):
                sequence.state.cancelled = True
                self.engine.abort(sequence.request_id)
        self._abort_abandoned(present, now)
        try:
            outputs, stats, _ = self._iterate(step=True)
        except CoreLost as exc:
            self.lose_everything(str(exc), present)
            return
        except Exception as exc:  # e.g. the new core would not start: no sequence may hang on it
            logger.exception("the engine iteration failed")
            self.lose_everything(f"internal error: the engine failed ({type(exc).__name__}: {exc})", present)
            return
        done_at = time.monotonic()
        for output in outputs:
            self._collect(output, done_at)
        for correlation_id, (request, sender) in present.items():
            self._respond(correlation_id, request, sender)
        if self.metrics is not None:
            self.metrics.update_engine_stats(stats)

    def _iterate(self, step: bool):
        """One engine iteration (EngineOutputs: outputs, stats, time); raises what the engine raised."""
        self.engine.flush(step=step)
        return self.engine.outbox.get_nowait()

    def _respond(self, correlation_id, request, sender) -> None:
        """The sequence's response of this iteration; rescheduled unless it ended."""
        sequence = self.sequences[correlation_id]
        try:
            done = sequence.state.flush(self.pb, sender, getattr(self.inputs, "tokenizer", None))
        except Exception:
            logger.exception("sending a response for %s failed", sequence.request_id)
            if sequence.state.final is None:  # cannot reach the client: stop generating for it
                self.engine.abort(sequence.request_id)  # goes with the next iteration
            done = True
        if done:
            self._forget(correlation_id)
        else:
            request.set_release_flags(self.pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)

    def reap_cancelled(self) -> int:
        """Aborts sequences whose client cancelled; returns how many.

        On Triton 2.51 a cancelled sequence is dropped from the sequence batcher and never handed
        to execute() again, so without this its engine request would run to max_tokens and hold
        its KV blocks. The watcher hands this to the engine's thread between iterations.
        """
        cancelled = [(c, s) for c, s in list(self.sequences.items())
                     if s.state.final is None and not s.state.cancelled and _is_cancelled(s.last_request, s.last_sender)]
        if not cancelled:
            return 0
        for correlation_id, sequence in cancelled:
            if self.metrics is not None:
                self.metrics.success["abort"].increment(1)
            self._forget(correlation_id)
            self.engine.abort(sequence.request_id)
        try:
            _, stats, _ = self._iterate(step=False)
        except Exception as exc:  # CoreLost, or a new core that would not start
            self.lose_everything(str(exc) if isinstance(exc, CoreLost) else f"internal error: {exc}", present={})
            return len(cancelled)
        if self.metrics is not None:
            self.metrics.update_engine_stats(stats)
        return len(cancelled)

    def begin_drain(self, grace_seconds: float) -> None:
        """Server stop or unload (backend/triton/drain.py): new sequences are refused, and those
        still running ``grace_seconds`` from now end with an error naming the shutdown (the core's
        deadline), before Triton's exit timeout cuts their streams."""
        self.engine.begin_drain(grace_seconds)

    def fail_all(self, message: str) -> None:
        """Unload: the engine stops, and every live sequence gets an error and its FINAL flag."""
        self.engine.stop(message=message)
        self.lose_everything(message)

    def lose_everything(self, message: str, present: dict | None = None) -> None:
        """Every live sequence ends with an error and its FINAL flag (the engine lost them all).

        The sequences of this execute() (``present``) get it now. The others were rescheduled and
        wait in the sequence batcher: Triton hands them back, so they keep the error and get it
        then. Answering one now would close its request while Triton still holds it, and when it
        came back it would look new and be served again (on Triton 2.51 the responses to a
        request after its FINAL crash tritonserver, SIGSEGV in TRITONBACKEND_ResponseSend).
        ``present`` None (unload: no execute() follows) sends every error now.
        """
        now = time.monotonic()
        for correlation_id, sequence in list(self.sequences.items()):
            sequence.state.collect(_lost_output(sequence, message), now, self.metrics)  # kept if it ended
            if present is not None and correlation_id not in present:
                continue  # its last response goes out when it comes back
            try:
                if sequence.last_sender is not None:
                    sequence.state.flush(self.pb, sequence.last_sender, getattr(self.inputs, "tokenizer", None))
            except Exception:
                logger.debug("closing %s failed", sequence.request_id, exc_info=True)
            self._forget(correlation_id)
        if self.metrics is not None:  # the gauges of a core that is gone: nothing runs, nothing waits
            self.metrics.update_engine_stats(empty_stats())

    # ------------------------------------------------------------------------------------------
    def _track(self, correlation_id, state: ResponseState, sender) -> None:
        """An admitted sequence (RequestAdmission's on_accept)."""
        self.sequences[correlation_id] = Sequence(state)
        self._by_request_id[state.request_id] = correlation_id

    def _collect(self, output: RequestOutput, now: float) -> None:
        """Keeps one engine output on its sequence until that sequence is in a batch."""
        correlation_id = self._by_request_id.get(output.request_id)
        sequence = None if correlation_id is None else self.sequences.get(correlation_id)
        if sequence is not None:
            sequence.state.collect(output, now, self.metrics)

    def _abort_abandoned(self, present: dict, now: float) -> None:
        """Sequences Triton stopped handing us: forgotten here, aborted with this iteration."""
        for correlation_id, sequence in list(self.sequences.items()):
            if correlation_id not in present and now - sequence.last_seen > ABANDONED_SECONDS:
                logger.warning("%s: Triton stopped scheduling it; aborting", sequence.request_id)
                self.engine.abort(sequence.request_id)
                self._forget(correlation_id)

    def _forget(self, correlation_id) -> None:
        sequence = self.sequences.pop(correlation_id, None)
        if sequence is not None:
            self._by_request_id.pop(sequence.request_id, None)


class CancelWatcher(PeriodicThread):
    """Hands ``driver.reap_cancelled`` to the engine's thread every poll, from a daemon thread."""

    def __init__(self, driver: IterativeDriver, worker: ThreadPoolExecutor):
        super().__init__(self._submit, CANCEL_POLL_SECONDS, "llm-iterative-cancel")
        self.driver = driver
        self.worker = worker
        self._pending: Future | None = None

    def _submit(self) -> bool:
        if self._pending is not None and not self._pending.done():
            return False  # the engine's thread is busy: one reap in its queue is enough
        try:
            self._pending = self.worker.submit(self._reap)
        except RuntimeError:  # the worker is shutting down
            return True
        return False

    def _reap(self) -> None:
        try:
            self.driver.reap_cancelled()
        except Exception:
            logger.exception("looking for cancelled sequences failed")


def _lost_output(sequence: Sequence, message: str) -> RequestOutput:
    """The error final of a sequence whose engine request is gone (no new tokens)."""
    state = sequence.state
    return RequestOutput(state.request_id, [], "", True, None, len(state.prompt_token_ids or ()), 0, error=message)


def _is_cancelled(request, sender) -> bool:
    for probe in (getattr(request, "is_cancelled", None), getattr(sender, "is_cancelled", None)):
        if probe is None:
            continue
        try:
            if probe():
                return True
        except Exception:
            continue
    return False


class TritonPythonModel(EngineModel):
    """Triton's entry points; model_repository/llm_iterative/1/model.py re-exports this class."""

    step_on_demand = True

    def start_serving(self) -> None:
        self.driver = IterativeDriver(self.pb, self.engine, self.inputs, self.model_name, self.metrics,
                                      self.config.model.prompt_byte_limit, self.stream_interval,
                                      self.client_priorities)
        # See the module docstring: the engine is much slower on the stub's main thread. It is
        # also the only thread that touches the engine (execute() and the cancellation reaper).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-iterative-engine")
        self.watcher = CancelWatcher(self.driver, self.worker)
        self.watcher.start()

    def begin_drain(self, grace_seconds: float) -> None:
        """From the watcher's thread: the drain runs on the engine's thread, like everything else."""
        try:
            self.worker.submit(self.driver.begin_drain, grace_seconds)
        except RuntimeError:  # the worker is shutting down: finalize ends every sequence anyway
            pass

    def execute(self, requests):
        self.worker.submit(self.driver.execute, requests).result()
        return None

    def stop_serving(self) -> None:
        self.watcher.stop()
        self.worker.submit(self.driver.fail_all, UNLOADING_MESSAGE).result()
        self.worker.shutdown(wait=True)
