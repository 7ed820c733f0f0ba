"""Streaming generation over tritonclient gRPC: one request, its responses, and their timing.

Used by ``python -m client.generate``, the load generator and the integration tests, so all of them
read responses the same way: text deltas, token ids, exactly one final response (Triton's
``triton_final_response`` parameter, with empty final responses enabled).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    np_to_triton_dtype,
    triton_to_np_dtype,
)


@dataclass(slots=True)
class StreamResult:
    """Everything one request produced, with client-side timing (seconds, monotonic clock)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int | None = None
    num_cached_tokens: int | None = None  # of the prompt, found in a cache (sent with num_input_tokens)
    num_output_tokens: int | None = None
    error: str | None = None
    num_responses: int = 0  # responses that carried data
    num_final: int = 0  # responses flagged final (exactly one when all is well)
    start_time: float = 0.0
    first_token_time: float | None = None
    end_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each response with tokens
    deltas: list[str] = field(default_factory=list)
    # Per data response, the optional outputs it carried as sent (finish_reason, the counts,
    # cumulative_logprob, logprobs): the vLLM-backend return_* flags change them per response.
    extras: list[dict] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # with sampling_parameters prompt_logprobs: of prompt tokens 1..n-1
    # With sampling_parameters logprobs: the chosen tokens' logprobs, per token the k best
    # {token_id, text, logprob} (logprobs k > 0), and the final response's cumulative_logprob.
    output_log_probs: list[float] = field(default_factory=list)
    top_logprobs: list[list[dict]] = field(default_factory=list)
    cumulative_logprob: float | None = None
    # With n > 1 samples (responses carry sequence_index): each sample's text, ids, finish reason.
    sample_texts: dict[int, str] = field(default_factory=dict)
    sample_token_ids: dict[int, list[int]] = field(default_factory=dict)
    sample_finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start_time

    def add_text(self, text: str, now: float) -> None:
        """A response that carried tokens (``text`` their text) arrived at ``now``."""
        self.text += text
        self.deltas.append(text)
        self.token_times.append(now)
        self.num_responses += 1
        if self.first_token_time is None:
            self.first_token_time = now


RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                "return_num_input_tokens", "return_num_output_tokens")


def build_inputs(prompt: str | None, **options) -> list[grpcclient.InferInput]:
    """The `llm` model's input tensors; options use the `llm` model's input names (docs/llm-model.md) (None: not sent).

    ``prompt`` None sends no text_input (pass ``messages``: a list of {role, content}, or its JSON).
    """
    kinds = {
        "max_tokens": np.int32, "min_length": np.int32, "top_k": np.int32, "priority": np.int32,
        "num_return_sequences": np.int32, "beam_width": np.int32, "length_penalty": np.float32,
        "early_stopping": bool,
        "temperature": np.float32, "top_p": np.float32, "random_seed": np.uint64, "seed": np.uint64,
        "frequency_penalty": np.float32, "presence_penalty": np.float32,
        "stream": bool, "ignore_eos": bool, "exclude_input_in_output": bool,
        **dict.fromkeys(RETURN_FLAGS, bool),
    }
    arrays: dict[str, np.ndarray] = {}
    if prompt is not None:
        arrays["text_input"] = np.array([[prompt.encode("utf-8")]], dtype=np.object_)
    for name, value in options.items():
        if value is None:
            continue
        if name == "stop_words":
            arrays[name] = np.array([[w.encode("utf-8") for w in value]], dtype=np.object_)
        elif name == "messages":
            text = value if isinstance(value, str) else json.dumps(value)
            arrays[name] = np.array([[text.encode("utf-8")]], dtype=np.object_)
        elif name == "sampling_parameters":
            text = value if isinstance(value, str) else json.dumps(value)
            arrays[name] = np.array([[text.encode("utf-8")]], dtype=np.object_)
        elif name == "input_ids":  # a prompt already tokenized (send prompt None)
            arrays[name] = np.array([list(value)], dtype=np.int32)
        elif name == "text_input_bytes":  # raw bytes, e.g. to send invalid UTF-8 on purpose
            arrays["text_input"] = np.array([[value]], dtype=np.object_)
        elif name in kinds:
            arrays[name] = np.array([[value]], dtype=kinds[name])
        else:
            raise ValueError(f"unknown input {name!r}")
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def decoded_outputs(raw) -> dict[str, np.ndarray]:
    """Every output of a ModelInferResponse, decoded once, flat (what ``InferResult.as_numpy`` gives,
    reshaped to -1). Why not as_numpy: it scans the outputs on each call and the load generator
    reads several per response, on the same two cores as the server."""
    arrays = {}
    contents = raw.raw_output_contents
    for index, output in enumerate(raw.outputs):
        if index >= len(contents):
            break
        if output.datatype == "BYTES":
            arrays[output.name] = deserialize_bytes_tensor(contents[index])
        else:
            arrays[output.name] = np.frombuffer(contents[index], dtype=triton_to_np_dtype(output.datatype))
    return arrays


def read_response(result: StreamResult, response, now: float) -> None:
    """Adds one response of ``result``'s request, arrived at ``now``, to it."""
    raw = response.get_response()
    if "triton_final_response" in raw.parameters and raw.parameters["triton_final_response"].bool_param:
        result.num_final += 1
    outputs = decoded_outputs(raw)
    if "text_output" not in outputs:
        return  # an empty final response
    result.num_responses += 1
    if "sequence_index" in outputs:
        _read_samples(result, outputs)
    text = b"".join(outputs["text_output"]).decode("utf-8")
    ids = outputs["output_ids"].tolist() if "output_ids" in outputs else []
    result.text += text
    result.deltas.append(text)
    result.token_ids.extend(ids)
    if ids:
        result.token_times.append(now)
        if result.first_token_time is None:
            result.first_token_time = now
    if "finish_reason" in outputs:
        reason = outputs["finish_reason"]
        if reason.size and reason[0]:
            result.finish_reason = reason[0].decode()
    if "output_log_probs" in outputs:
        result.output_log_probs.extend(outputs["output_log_probs"].tolist())
    if "top_logprobs" in outputs:
        result.top_logprobs.extend(json.loads(outputs["top_logprobs"][0]))
    if "cumulative_logprob" in outputs:
        result.cumulative_logprob = float(outputs["cumulative_logprob"][-1])
    if "prompt_logprobs" in outputs:
        result.prompt_logprobs = outputs["prompt_logprobs"].tolist()
    if "num_input_tokens" in outputs:
        result.num_input_tokens = int(outputs["num_input_tokens"][0])
    if "num_cached_tokens" in outputs:
        result.num_cached_tokens = int(outputs["num_cached_tokens"][0])
    if "num_output_tokens" in outputs:
        count = int(outputs["num_output_tokens"][0])
        if "output_ids" in outputs:
            result.num_output_tokens = count
        else:  # Triton's vLLM backend (return_num_output_tokens): no ids, each response counts its own tokens
            result.num_output_tokens = (result.num_output_tokens or 0) + count
            if count:
                result.token_times.append(now)
                if result.first_token_time is None:
                    result.first_token_time = now
    extras = {}
    for name in ("finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob", "logprobs"):
        if name in outputs:
            value = outputs[name][0]
            if name in ("finish_reason", "logprobs"):
                value = value.decode("utf-8")
                if name == "logprobs":
                    value = json.loads(value)
            extras[name] = value.item() if hasattr(value, "item") else value
    result.extras.append(extras)


def _read_samples(result: StreamResult, outputs: dict[str, np.ndarray]) -> None:
    """A response of an n > 1 request: one sample's delta (streaming), or all n (its [1, n] tensors,
    ``output_ids`` split by ``num_output_tokens``, not streaming)."""
    indices = outputs["sequence_index"].tolist()
    texts = [t.decode("utf-8") for t in outputs["text_output"]]
    ids = outputs["output_ids"].tolist() if "output_ids" in outputs else []
    reasons = [r.decode() for r in outputs["finish_reason"]] if "finish_reason" in outputs else []
    if len(indices) > 1:
        counts = outputs["num_output_tokens"].tolist()
        prompt_ids = len(ids) - sum(counts)  # the prompt's ids lead every sample when it is included
        split, start = [], 0
        for count in counts:
            length = count + prompt_ids // len(counts)
            split.append(ids[start:start + length])
            start += length
    else:
        split = [ids]
    for position, index in enumerate(indices):
        result.sample_texts[index] = result.sample_texts.get(index, "") + texts[position]
        result.sample_token_ids.setdefault(index, []).extend(split[position])
        if position < len(reasons) and reasons[position]:
            result.sample_finish_reasons[index] = reasons[position]


class StreamingClient:
    """One gRPC stream to the server; runs requests one after another or several at once."""

    def __init__(self, url: str, model_name: str = "llm", headers: dict[str, str] | None = None):
        """``headers``: gRPC metadata sent when the stream opens, e.g. client.routing's session header
        (a proxy routes the whole stream by it, so every request on it reaches the same replica)."""
        self.url = url
        self.model_name = model_name
        self.client = grpcclient.InferenceServerClient(url=url)
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self.client.start_stream(callback=lambda result, error: self._responses.put((time.monotonic(), result, error)),
                                 headers=headers)

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        # Leaving on an error (a TimeoutError above all) cancels what is still open: a stream the
        # server never ends (a dead decoupled stub's) would hold a plain stop_stream() forever.
        self.close(cancel_requests=exc_type is not None)

    def send(self, prompt: str | None, request_id: str | None = None, **options) -> str:
        """Starts one request on the stream; returns its id."""
        request_id = request_id or uuid.uuid4().hex
        self.client.async_stream_infer(
            self.model_name, build_inputs(prompt, **options), request_id=request_id,
            enable_empty_final_response=True,
        )
        return request_id

    def collect(self, request_ids: list[str], start_times: dict[str, float], timeout: float = 300.0,
                on_response=None) -> dict[str, StreamResult]:
        """Reads responses until every request got its final one (or raises TimeoutError)."""
        return collect_responses(self._responses, request_ids, start_times, timeout, on_response)

    def generate(self, prompt: str, timeout: float = 300.0, **options) -> StreamResult:
        start = time.monotonic()
        rid = self.send(prompt, **options)
        return self.collect([rid], {rid: start}, timeout)[rid]


def collect_responses(responses: queue.SimpleQueue, request_ids: list[str], start_times: dict[str, float],
                      timeout: float = 300.0, on_response=None) -> dict[str, StreamResult]:
    """Reads (arrival time, response, error) items off ``responses`` until every request got its
    final response (or raises TimeoutError); what StreamingClient and SharedStream wait with."""
    results = {rid: StreamResult(start_time=start_times[rid]) for rid in request_ids}
    pending = set(request_ids)
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{len(pending)} requests got no final response within {timeout:.0f} s")
        try:
            now, response, error = responses.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if error is not None:
            rid = _error_request_id(error, pending)
            if rid is None:
                raise RuntimeError(f"stream error for an unknown request: {error}")
            results[rid].error = error_message(error)
            results[rid].num_final += 1  # Triton ends a request with its error
            results[rid].end_time = now
            pending.discard(rid)
            continue
        rid = response.get_response().id
        if rid not in results:
            continue
        result = results[rid]
        read_response(result, response, now)
        if on_response is not None:
            on_response(rid, result)
        if result.num_final and rid in pending:
            result.end_time = now
            pending.discard(rid)
    return results


class SharedStream:
    """One gRPC stream carrying many requests at once from many threads (a decoupled Triton model
    takes any number in flight on one stream), each thread waiting for its own responses.

    Why: the load generator's users each opened their own client and stream; on the 2 cores that
    also run the server, 64 gRPC channels with their threads cost the client 4-5 CPU seconds per
    mixed-workload run, against 0.8 for vLLM's HTTP client. ``run`` is thread-safe.
    """

    def __init__(self, url: str, model_name: str = "llm"):
        self.model_name = model_name
        self._waiters: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self.client = grpcclient.InferenceServerClient(url=url)
        self.client.start_stream(callback=self._dispatch)

    def _dispatch(self, result, error) -> None:
        now = time.monotonic()
        with self._lock:
            if error is None:
                waiter = self._waiters.get(result.get_response().id)
                targets = [] if waiter is None else [waiter]
            else:  # an error names its request when it can; otherwise every waiter hears of it
                rid = _error_request_id(error, set(self._waiters))
                targets = [self._waiters[rid]] if rid is not None else list(self._waiters.values())
        for target in targets:
            target.put((now, result, error))

    def generate(self, prompt: str | None, timeout: float = 300.0, on_response=None, **options) -> StreamResult:
        """Sends one request on the shared stream and waits for its final response."""
        request_id = uuid.uuid4().hex
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._waiters[request_id] = waiter
        try:
            start = time.monotonic()
            self.client.async_stream_infer(self.model_name, build_inputs(prompt, **options), request_id=request_id,
                                           enable_empty_final_response=True)
            return collect_responses(waiter, [request_id], {request_id: start}, timeout, on_response)[request_id]
        finally:
            with self._lock:
                self._waiters.pop(request_id, None)

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


def error_message(error) -> str:
    if isinstance(error, InferenceServerException):
        return error.message()
    return str(error)


def _error_request_id(error, pending: set[str]) -> str | None:
    """tritonclient reports stream errors without the response; find the request they belong to."""
    request_id = getattr(error, "request_id", None)
    if callable(request_id):
        request_id = request_id()
    if request_id in pending:
        return request_id
    if len(pending) == 1:
        return next(iter(pending))
    return None
