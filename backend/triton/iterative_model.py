"""The `llm_iterative` model: Triton's sequence batcher (``iterative_sequence: true``) drives the engine.

The client sends one request; Triton turns it into a sequence and hands it to execute() again and
again until it is released without the RESCHEDULE flag. Each execute() does, on the calling thread:

1. new sequences (first sight of a correlation id) are parsed with the `llm` model's rules and
   added to the engine; a bad one gets an error response + FINAL and is not rescheduled;
2. cancelled sequences are aborted in the engine (their KV blocks are freed at once);
3. one engine iteration (adds, aborts, one step: ``core.iterate``) -- the engine still owns the
   token budget and KV admission, so a sequence it cannot advance this iteration gets no response
   and is simply rescheduled;
4. each sequence present gets one response with everything produced for it since its last
   response (FINAL when it ended), and the unfinished ones are rescheduled before returning.

The engine schedules all its requests, not only the ones in this batch (with the `oldest` strategy
Triton may hold some back): outputs of absent sequences are buffered until they come back.
The engine runs in its own process by default (``engine_process: true``; it steps only when an
iteration asks, backend/engine_core/sync_client.py); with ``engine_process: false`` it runs in
this process. Either way one dedicated thread makes the calls and execute() waits for it: measured
here, torch on the stub's main thread (2 intra-op threads, cores shared) took 180-380 ms per decode
step against 21 ms on a worker thread. Responses follow the
same rules as `llm`'s (backend/triton/response_state.py), flushed once per execute().
Traps measured on Triton 2.51 (DESIGN.md): null requests (correlation id 0) fill empty slots of
the `direct` strategy and are skipped; rescheduling only works before execute() returns; Triton's
own success counters count iterations, so request-level metrics come from here.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from backend.engine.input_processor import EngineInputError
from backend.engine.outputs import RequestOutput
from backend.engine_core.client import empty_stats
from backend.engine_core.core import DRAINING_MESSAGE
from backend.engine_core.messages import AddRequest
from backend.triton.helpers import (
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    engine_process_options,
    input_getter,
    load_llm_config,
    seconds_parameter,
    send_error,
    set_utf8_locale,
    start_engine_core,
    start_unload_watcher,
    stub_watch,
    triton_readiness_url,
)
from backend.triton.inputs import InputError, parse_request
from backend.triton.periodic import PeriodicThread
from backend.triton.response_state import ResponseState

logger = logging.getLogger(__name__)

# A sequence Triton stopped handing us (its client vanished without a cancel) is aborted after this.
ABANDONED_SECONDS = 600.0
# How often the watcher looks for cancelled sequences between iterations.
CANCEL_POLL_SECONDS = 0.1


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

    ``core`` is the engine: ``iterate(adds, aborts, step) -> (outputs, stats)`` and
    ``shutdown(message)`` (backend/engine_core/sync_client.py: in this process or in its own);
    ``inputs`` checks, renders and tokenizes requests (backend/engine/input_processor.py). Every method
    runs on the one thread that owns the engine (the model's worker thread), the cancellation
    reaper included: no lock.
    """

    def __init__(self, pb, core, inputs, model_name: str, max_queue_len: int, default_max_tokens: int,
                 metrics=None, max_prompt_bytes: int | None = None):
        self.pb = pb
        self.core = core
        self.inputs = inputs
        self.model_name = model_name
        self.max_queue_len = max_queue_len
        self.default_max_tokens = default_max_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self.metrics = metrics
        self.sequences: dict[object, Sequence] = {}  # correlation id -> sequence
        self._by_request_id: dict[str, object] = {}  # engine request id -> correlation id
        self._num_waiting = 0  # the engine's, after the last iteration
        self._deferred_aborts: list[str] = []  # requests to abort with the next iteration
        self.draining = False

    # ------------------------------------------------------------------------------------------
    def execute(self, requests) -> None:
        from backend.engine_core.sync_client import CoreLost  # noqa: PLC0415

        now = time.monotonic()
        present: dict[object, tuple[object, object]] = {}  # correlation id -> (request, sender)
        adds: list[AddRequest] = []
        aborts, self._deferred_aborts = self._deferred_aborts, []
        for request in requests:
            correlation_id = request.correlation_id()
            if not correlation_id:
                continue  # a null request filling an empty slot of the `direct` strategy
            sender = request.get_response_sender()
            sequence = self.sequences.get(correlation_id)
            if sequence is None:
                try:
                    sequence = self._admit(request, sender, correlation_id, now, adds)
                except Exception as exc:  # one request's failure must not fail the batch (see llm_model)
                    logger.exception("admitting a sequence failed")
                    try:
                        send_error(self.pb, sender, f"internal error while reading the request: {exc}")
                    except Exception:
                        logger.exception("sending an error response failed")
                    continue
                if sequence is None:
                    continue  # refused: error + FINAL sent, not rescheduled
            sequence.last_seen = now
            sequence.last_request, sequence.last_sender = request, sender
            present[correlation_id] = (request, sender)
            if not sequence.state.cancelled and sequence.state.final is None and _is_cancelled(request, sender):
                sequence.state.cancelled = True
                aborts.append(sequence.request_id)
        aborts.extend(self._abandoned(present, now))
        try:
            outputs, stats = self.core.iterate(adds, aborts, step=True)
        except CoreLost as exc:
            self.lose_everything(str(exc), present)
            return
        except Exception as exc:  # e.g. the new core would not start: no sequence may hang on it
            logger.exception("the engine iteration failed")
            self.lose_everything(f"internal error: the engine failed ({type(exc).__name__}: {exc})", present)
            return
        self._num_waiting = stats.num_waiting
        done_at = time.monotonic()
        for output in outputs:
            self._collect(output, done_at)
        for correlation_id, (request, sender) in present.items():
            sequence = self.sequences[correlation_id]
            try:
                done = sequence.state.flush(self.pb, sender, getattr(self.inputs, "tokenizer", None))
            except Exception:
                logger.exception("sending a response for %s failed", sequence.request_id)
                if sequence.state.final is None:  # cannot reach the client: stop generating for it
                    self._deferred_aborts.append(sequence.request_id)
                done = True
            if done:
                self._forget(correlation_id)
            else:
                request.set_release_flags(self.pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        if self.metrics is not None:
            self.metrics.update_engine_stats(stats)

    def reap_cancelled(self) -> int:
        """Aborts sequences whose client cancelled; returns how many.

        Measured on Triton 2.51: a cancelled sequence is dropped from the sequence batcher and never
        handed to execute() again, so without this its engine request would run to max_tokens and
        hold its KV blocks. The watcher hands this to the engine's thread between iterations.
        """
        from backend.engine_core.sync_client import CoreLost  # noqa: PLC0415

        cancelled = [(c, s) for c, s in list(self.sequences.items())
                     if s.state.final is None and not s.state.cancelled and _is_cancelled(s.last_request, s.last_sender)]
        if not cancelled:
            return 0
        for correlation_id, _ in cancelled:
            if self.metrics is not None:
                self.metrics.success["abort"].increment(1)
            self._forget(correlation_id)
        try:
            _, stats = self.core.iterate([], [s.request_id for _, s in cancelled], step=False)
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
        if not self.draining:
            self.draining = True
            self.core.begin_drain(grace_seconds)

    def fail_all(self, message: str) -> None:
        """Unload: the engine stops, and every live sequence gets an error and its FINAL flag."""
        self.core.shutdown(message)
        self.lose_everything(message)

    def lose_everything(self, message: str, present: dict | None = None) -> None:
        """Every live sequence ends with an error and its FINAL flag (the engine lost them all).

        The sequences of this execute() (``present``) get it now. The others were rescheduled and
        wait in the sequence batcher: Triton hands them back, so they keep the error and get it
        then. Answering one now would close its request while Triton still holds it, and when it
        came back it would look new and be served again (measured on Triton 2.51: the responses
        to a request after its FINAL crash tritonserver, SIGSEGV in TRITONBACKEND_ResponseSend).
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
        self._deferred_aborts.clear()
        if self.metrics is not None:  # the gauges of a core that is gone: nothing runs, nothing waits
            self.metrics.update_engine_stats(empty_stats())

    # ------------------------------------------------------------------------------------------
    def _admit(self, request, sender, correlation_id, now: float, adds: list[AddRequest]) -> Sequence | None:
        pb = self.pb
        try:
            parsed = parse_request(input_getter(pb, request), self.default_max_tokens,
                                   self.inputs.check_sampling_params, self.max_prompt_bytes)
            prompt, add_special_tokens = parsed.prompt, True
            if parsed.messages is not None:
                prompt, add_special_tokens = self.inputs.render_chat(parsed.messages), False
        except (InputError, EngineInputError) as exc:
            send_error(pb, sender, str(exc), pb.TritonError.INVALID_ARG)
            return None
        if self.draining:
            send_error(pb, sender, DRAINING_MESSAGE, pb.TritonError.UNAVAILABLE)
            return None
        waiting = self._num_waiting + len(adds)
        if waiting >= self.max_queue_len:
            send_error(pb, sender, f"server busy: {waiting} requests are waiting (max_queue_len="
                                   f"{self.max_queue_len}); retry later", pb.TritonError.UNAVAILABLE)
            return None
        request_id = f"{self.model_name}-{correlation_id}"
        prompt_token_ids = self.inputs.tokenize(prompt, add_special_tokens)  # a failure: execute() answers
        adds.append(AddRequest(request_id, prompt_token_ids, parsed.sampling_params, now))
        state = ResponseState(request_id, parsed.stream, parsed.exclude_input_in_output, prompt, now,
                              returns=parsed.returns, wants_logprobs=parsed.sampling_params.logprobs,
                              prompt_token_ids=prompt_token_ids, num_samples=parsed.sampling_params.n)
        sequence = Sequence(state)
        self.sequences[correlation_id] = sequence
        self._by_request_id[request_id] = correlation_id
        return sequence

    def _collect(self, output: RequestOutput, now: float) -> None:
        """Keeps one engine output on its sequence until that sequence is in a batch."""
        correlation_id = self._by_request_id.get(output.request_id)
        sequence = None if correlation_id is None else self.sequences.get(correlation_id)
        if sequence is not None:
            sequence.state.collect(output, now, self.metrics)

    def _abandoned(self, present: dict, now: float) -> list[str]:
        """Sequences Triton stopped handing us: forgotten here, their ids to abort."""
        abandoned = []
        for correlation_id, sequence in list(self.sequences.items()):
            if correlation_id not in present and now - sequence.last_seen > ABANDONED_SECONDS:
                logger.warning("%s: Triton stopped scheduling it; aborting", sequence.request_id)
                abandoned.append(sequence.request_id)
                self._forget(correlation_id)
        return abandoned

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


class TritonPythonModel:
    """Triton's entry points; model_repository/llm_iterative/1/model.py re-exports this class."""

    def initialize(self, args: dict) -> None:
        set_utf8_locale()
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 (only inside the stub)

        from backend.triton.metrics import TritonMetrics  # noqa: PLC0415

        model_name, config, parameters = load_llm_config(pb_utils, args, needs_iterative_sequence=True)
        use_process, heartbeat_timeout = engine_process_options(parameters)
        self.metrics = TritonMetrics(pb_utils, model_name)
        ready_url = triton_readiness_url(parameters, model_name, str(args.get("model_version", "")))
        core, inputs = (self._start_engine_core(model_name, config, heartbeat_timeout, stub_watch(parameters, ready_url))
                        if use_process else self._start_in_process(config))
        self.driver = IterativeDriver(
            pb_utils, core, inputs, model_name, config.scheduler.max_queue_len,
            config.scheduler.default_max_tokens, self.metrics, config.model.prompt_byte_limit,
        )
        # See the module docstring: the engine is much slower on the stub's main thread. It is
        # also the only thread that touches the engine (execute() and the cancellation reaper).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-iterative-engine")
        self.watcher = CancelWatcher(self.driver, self.worker)
        self.watcher.start()
        grace = seconds_parameter(parameters, "shutdown_grace_seconds", DEFAULT_SHUTDOWN_GRACE_SECONDS)
        self.unload_watcher = start_unload_watcher(ready_url, lambda: self._submit_drain(grace))

    def _submit_drain(self, grace: float) -> None:
        """From the watcher's thread: the drain runs on the engine's thread, like everything else."""
        try:
            self.worker.submit(self.driver.begin_drain, grace)
        except RuntimeError:  # the worker is shutting down: finalize ends every sequence anyway
            pass

    def _start_engine_core(self, model_name: str, config, heartbeat_timeout: float, watch):
        """The engine in its own process, stepping on demand (backend/engine_core/sync_client.py)."""
        from backend.engine_core.sync_client import SyncEngineCoreClient  # noqa: PLC0415

        metrics = self.metrics
        core = SyncEngineCoreClient(config, heartbeat_timeout,
                                    on_restart=lambda reason: metrics.engine_restarts.increment(1), stub_watch=watch)
        return core, start_engine_core(core, model_name, config.model.tokenizer_dir)

    def _start_in_process(self, config):
        from backend.engine.llm_engine import LLMEngine  # noqa: PLC0415
        from backend.engine_core.sync_client import InProcessCore  # noqa: PLC0415

        engine = LLMEngine(config)
        return InProcessCore(engine), engine.input_processor

    def execute(self, requests):
        self.worker.submit(self.driver.execute, requests).result()
        return None

    def finalize(self) -> None:
        """Requests still live get an error and their FINAL flag, so no client hangs."""
        for name in ("unload_watcher", "watcher"):
            watcher = getattr(self, name, None)
            if watcher is not None:
                watcher.stop()
        worker = getattr(self, "worker", None)
        driver = getattr(self, "driver", None)
        if worker is not None and driver is not None:
            worker.submit(driver.fail_all, "the model is being unloaded").result()
        if worker is not None:
            worker.shutdown(wait=True)
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
