"""What is sent back for one request until its FINAL flag, shared by `llm` and `llm_iterative`.

Engine outputs are collected as they come (metrics are recorded then: TTFT, ITL, counts); a flush
turns everything collected since the last one into at most one response. The two models differ
only in when they flush: the `llm` responder once per wake-up for every request it has news of
(backend/triton/responder.py), `llm_iterative` once per execute(). The rules of a flush:

- a cancelled request gets nothing more, then only a bare FINAL flag once the engine ended it;
- an engine error ends the request with an error response (FINAL);
- otherwise a response goes out when the request ended (FINAL, with everything not sent yet) or
  when it streams and has new tokens: its first token at once, after that once at least
  ``stream_interval`` tokens wait (config.pbtxt ``stream_interval``, or per request in
  ``sampling_parameters``; 1 sends every token); a non-streaming request waits for its end;
- the first response carries the prompt too when ``exclude_input_in_output`` is false.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from backend.protocol.outputs import RequestOutput
from backend.triton.helpers import send_error
from backend.triton.inputs import ReturnOptions
from backend.triton.metrics import TritonMetrics, record_finish, record_tokens
from backend.triton.return_outputs import delta_response
from backend.triton.sequence_responses import SampleState, collect_sample, flush_samples
from backend.triton.stream_interval import streams_now


@dataclass(slots=True)
class ResponseState:
    request_id: str  # the engine's id
    stream: bool
    exclude_input_in_output: bool
    prompt: str
    arrival_time: float
    returns: ReturnOptions = ReturnOptions()  # the vLLM backend's return_* flags
    wants_logprobs: bool = False  # the request asked for logprobs (sampling_parameters)
    pending: list[RequestOutput] = field(default_factory=list)  # collected, not sent yet
    final: RequestOutput | None = None  # set when the engine ended the request
    prompt_token_ids: list[int] | None = None  # the tokenized prompt (set by whoever tokenized it)
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_sent: bool = False
    cancelled: bool = False
    cumulative_logprob: float = 0.0
    stream_interval: int = 1  # a streamed response waits for this many new tokens (not the first, not the last)
    num_tokens_sent: int = 0  # output tokens sent so far (without n > 1)
    num_samples: int = 1  # n > 1: backend/triton/sequence_responses.py sends the responses
    samples: list = field(default_factory=list)  # with n > 1: one SampleState per sample
    requested_outputs: frozenset[str] | None = None  # the outputs the client asked for (None: all)

    def __post_init__(self) -> None:
        if self.num_samples > 1:
            self.samples = [SampleState() for _ in range(self.num_samples)]

    def collect(self, output: RequestOutput, now: float, metrics: TritonMetrics | None) -> None:
        """Takes one engine output (in order) and records its metrics."""
        if self.final is not None:
            return
        if self.samples:
            collect_sample(self, output, now, metrics)
            return
        if output.new_token_ids and not self.cancelled:
            record_tokens(self, output, now, metrics)
        if output.logprobs:
            self.cumulative_logprob += sum(output.logprobs)
        self.pending.append(output)
        if output.finished:
            self.final = output
            record_finish(self, output, now, metrics)

    def flush(self, pb, sender, tokenizer=None) -> bool:
        """Sends at most one response for what was collected (see the module docstring); returns
        True once the FINAL flag went out (the request and its sender are then done with)."""
        final = self.final
        if self.cancelled:
            if final is not None:
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # the client is gone: just close
            return final is not None
        if final is not None and final.error is not None:
            send_error(pb, sender, final.error)
            return True
        if self.samples:
            return flush_samples(self, pb, sender, tokenizer)
        num_new = sum(len(o.new_token_ids) for o in self.pending)
        if final is None and not (self.stream and streams_now(num_new, self.num_tokens_sent, self.stream_interval)):
            return False
        outputs, self.pending = self.pending, []
        self.num_tokens_sent += num_new
        response = self._response(pb, outputs, final, tokenizer)
        if final is None:
            sender.send(response)
            return False
        sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return True

    def _response(self, pb, outputs: list[RequestOutput], final: RequestOutput | None, tokenizer):
        extra = []
        prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
        if prompt_logprobs is not None:  # once, on the response with the first token
            extra.append(pb.Tensor("prompt_logprobs", np.array([prompt_logprobs], dtype=np.float32).reshape(1, -1)))
        if final is not None and final.kv_transfer_params is not None and (
                self.requested_outputs is None or "kv_transfer_params" in self.requested_outputs):
            # a prefill engine's answer: where a decode engine pulls this prompt's KV (vLLM's keys)
            text = json.dumps(final.kv_transfer_params)
            extra.append(pb.Tensor("kv_transfer_params", np.array([[text.encode("utf-8")]], dtype=np.object_)))
        return delta_response(pb, self, self, outputs, final, tokenizer, extra)
