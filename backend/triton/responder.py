"""The response thread: turns engine outputs into Triton responses and watches for cancellation.

Each request gets its text deltas (``stream=true``) or one response with all its text, and exactly
one FINAL flag: after its last token, after an error, and after a cancellation too. Cancelled
requests (the client cancelled the gRPC call or closed the stream) are aborted in the engine so
their KV blocks are freed at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from backend.engine import RequestOutput
from backend.triton.engine_loop import EngineLoop
from backend.triton.inputs import ReturnOptions
from backend.triton.metrics import TritonMetrics, record_finish, record_tokens
from backend.triton.return_outputs import extra_tensors, finish_reason_text, logprob_entries, token_counts

logger = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.1


@dataclass(slots=True)
class ActiveRequest:
    """What the response thread keeps for one request until its FINAL flag is sent."""

    request_id: str
    sender: object  # pb_utils.InferenceResponseSender
    stream: bool
    exclude_input_in_output: bool
    prompt: str
    arrival_time: float
    text_parts: list[str] = field(default_factory=list)  # stream=false: everything so far
    token_ids: list[int] = field(default_factory=list)  # stream=false: everything so far
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_sent: bool = False
    cancelled: bool = False
    returns: ReturnOptions = ReturnOptions()  # the vLLM backend's return_* flags
    wants_logprobs: bool = False  # the request asked for logprobs (sampling_parameters)
    cumulative_logprob: float = 0.0
    outputs: list[RequestOutput] = field(default_factory=list)  # stream=false: for logprobs at the end


def build_response(pb, text: str, token_ids: list[int], finish_reason: str = "",
                   num_input_tokens: int | None = None, num_output_tokens: int | None = None, extra=()):
    """One `llm` response: text_output, output_ids, finish_reason; the token counts when given.

    Shared by the `llm` responder thread and the `llm_iterative` model so both send the same tensors.
    """
    tensors = [
        pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
        pb.Tensor("output_ids", np.array([token_ids], dtype=np.int32).reshape(1, -1)),
        pb.Tensor("finish_reason", np.array([[finish_reason.encode()]], dtype=np.object_)),
    ]
    if num_input_tokens is not None:
        tensors.append(pb.Tensor("num_input_tokens", np.array([[num_input_tokens]], dtype=np.int32)))
    if num_output_tokens is not None:
        tensors.append(pb.Tensor("num_output_tokens", np.array([[num_output_tokens]], dtype=np.int32)))
    tensors.extend(extra)
    return pb.InferenceResponse(output_tensors=tensors)


class Responder:
    def __init__(self, pb_utils, loop: EngineLoop, metrics: TritonMetrics | None, tokenizer=None):
        self.pb = pb_utils
        self.loop = loop
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
                item = self.loop.outbox.get(timeout=CANCEL_POLL_SECONDS)
            except queue.Empty:
                item = ()
            if item is None:
                self._fail_remaining("the model is being unloaded")
                return
            if item:
                outputs, stats = item
                for output in outputs:
                    try:
                        self._handle(output)
                    except Exception:
                        logger.exception("sending a response for %s failed", output.request_id)
                if self.metrics is not None:
                    self.metrics.update_engine_stats(stats)
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + CANCEL_POLL_SECONDS

    def _poll_cancellations(self) -> None:
        with self._lock:
            candidates = [a for a in self._active.values() if not a.cancelled]
        for active in candidates:
            try:
                cancelled = active.sender.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                active.cancelled = True
                self.loop.abort(active.request_id)

    def _handle(self, output: RequestOutput) -> None:
        with self._lock:
            active = self._active.get(output.request_id)
        if active is None:
            return
        now = time.monotonic()
        num_new = len(output.new_token_ids)
        if num_new and not active.cancelled:
            record_tokens(active, output, now, self.metrics)
        if output.logprobs:
            active.cumulative_logprob += sum(output.logprobs)
        if not active.stream:
            active.text_parts.append(output.text)
            active.token_ids.extend(output.new_token_ids)
            if active.returns.logprobs:
                active.outputs.append(output)
        if output.finished:
            self._finish(active, output, now)
        elif active.stream and not active.cancelled:
            active.sender.send(self._response(active, output.text, output.new_token_ids, output, None))

    def _finish(self, active: ActiveRequest, output: RequestOutput, now: float) -> None:
        final_flag = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.unregister(active.request_id)
        record_finish(active, output, now, self.metrics)
        if active.cancelled:
            active.sender.send(flags=final_flag)  # the client is gone: just close the stream
            return
        if output.error is not None:
            error = self.pb.TritonError(output.error)
            active.sender.send(self.pb.InferenceResponse(output_tensors=[], error=error), flags=final_flag)
            return
        if active.stream:
            text, token_ids, outputs = output.text, output.new_token_ids, [output]
        else:
            text, token_ids, outputs = "".join(active.text_parts), active.token_ids, active.outputs
        active.sender.send(self._response(active, text, token_ids, output, output, outputs), flags=final_flag)

    def _response(self, active: ActiveRequest, text: str, token_ids: list[int], output: RequestOutput,
                  final: RequestOutput | None, outputs: list[RequestOutput] | None = None):
        """One response: text_output and output_ids, finish_reason, the counts and extras asked for."""
        pb = self.pb
        num_new_tokens = len(token_ids)
        if not active.exclude_input_in_output and not active.prompt_sent:
            active.prompt_sent = True  # the first response carries the prompt too
            text = active.prompt + text
            token_ids = list(output.prompt_token_ids or []) + list(token_ids)
        returns = active.returns
        num_input, num_output = token_counts(returns, output, num_new_tokens, final)
        extra = ()
        if returns.logprobs or returns.cumulative_logprob:
            entries = logprob_entries(self.tokenizer, outputs or [output]) if returns.logprobs else []
            extra = extra_tensors(pb, returns, active.wants_logprobs, active.cumulative_logprob, entries)
        return build_response(pb, text, token_ids, finish_reason_text(returns, final), num_input, num_output, extra)

    def _fail_remaining(self, message: str) -> None:
        with self._lock:
            remaining = list(self._active.values())
            self._active.clear()
        for active in remaining:
            try:
                if active.cancelled:
                    active.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    active.sender.send(
                        self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message)),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
            except Exception:
                logger.exception("closing %s failed", active.request_id)
