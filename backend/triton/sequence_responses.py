"""The responses of a request with n > 1 samples (parallel sampling, backend/engine/sequence_group.py).

Streaming: each flush sends one response per sample that has tokens to send (a response carries
one sample's delta and its ``sequence_index``; ``stream_interval`` counts each sample's tokens, and
a sample's first and last tokens go at once); the FINAL flag goes on the last response after every
sample ended, alone (a bare FINAL) when nothing was left to send. Not streaming: one response at
the end whose tensors hold the n samples in order: ``text_output`` [1, n], ``finish_reason``
[1, n], ``num_output_tokens`` [1, n], ``sequence_index`` [1, n] = 0..n-1, and ``output_ids``
[1, sum of lengths], the samples' ids one after another (``num_output_tokens`` splits them).
When ``exclude_input_in_output`` is false, each sample's text (and ids) starts with the prompt.
Metrics: TTFT is the request's first token of any sample, ITL the gaps within each sample, and
the generation-token counter counts every sample's tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np

from backend.protocol.outputs import RequestOutput
from backend.triton.metrics import record_finish, record_tokens
from backend.triton.return_outputs import delta_response, delta_text, finish_reason_text, logprob_entries
from backend.triton.stream_interval import streams_now


@dataclass(slots=True)
class SampleState:
    """One sample's part of the request's state."""

    pending: list[RequestOutput] = field(default_factory=list)
    final: RequestOutput | None = None  # its last output
    last_token_time: float | None = None
    prompt_sent: bool = False
    cumulative_logprob: float = 0.0
    num_output_tokens: int = 0
    num_tokens_sent: int = 0


def collect_sample(state, output: RequestOutput, now: float, metrics) -> None:
    """ResponseState.collect for n > 1 (``state`` is the ResponseState)."""
    sample = state.samples[output.sequence_index]
    if output.new_token_ids and not state.cancelled:
        if state.first_token_time is None:
            record_tokens(state, output, now, metrics)  # TTFT, prompt and generation tokens
        elif metrics is not None:
            if sample.last_token_time is not None:
                metrics.itl.observe(now - sample.last_token_time)
            metrics.generation_tokens.increment(len(output.new_token_ids))
        sample.last_token_time = state.last_token_time = now
    if output.logprobs:
        sample.cumulative_logprob += sum(output.logprobs)
    sample.num_output_tokens = output.num_output_tokens
    sample.pending.append(output)
    if output.sequence_finished:
        sample.final = output
    if output.finished:
        state.final = output
        total = sum(s.num_output_tokens for s in state.samples)
        record_finish(state, replace(output, num_output_tokens=total), now, metrics)


def flush_samples(state, pb, sender, tokenizer) -> bool:
    """ResponseState.flush for n > 1 once cancellation and errors are handled; True after FINAL."""
    if state.stream:
        responses = []
        for index, sample in enumerate(state.samples):
            num_new = sum(len(o.new_token_ids) for o in sample.pending)
            due = sample.pending and (sample.final is not None or (state.final is not None and num_new > 0))
            if not due and not streams_now(num_new, sample.num_tokens_sent, state.stream_interval):
                continue
            outputs, sample.pending = sample.pending, []
            sample.num_tokens_sent += num_new
            responses.append(delta_response(pb, state, sample, outputs, sample.final, tokenizer,
                                            [pb.Tensor("sequence_index", np.array([[index]], dtype=np.int32))]))
        if state.final is None:
            for response in responses:
                sender.send(response)
            return False
        for response in responses[:-1]:
            sender.send(response)
        if responses:
            sender.send(responses[-1], flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return True
    if state.final is None:
        return False
    texts, ids, reasons, counts, cumulative, logprobs = [], [], [], [], [], []
    for sample in state.samples:
        outputs, sample.pending = sample.pending, []
        text, token_ids = delta_text(state, sample, outputs)
        entries = logprob_entries(tokenizer, outputs) if state.returns.logprobs else []
        texts.append(text.encode("utf-8"))
        ids.extend(token_ids)
        reasons.append(finish_reason_text(state.returns, sample.final or state.final).encode())
        counts.append(sample.num_output_tokens)
        cumulative.append(sample.cumulative_logprob)
        logprobs.append((json.dumps(entries) if state.wants_logprobs else "null").encode("utf-8"))
    n = len(state.samples)
    tensors = [
        pb.Tensor("text_output", np.array([texts], dtype=np.object_)),
        pb.Tensor("output_ids", np.array([ids], dtype=np.int32).reshape(1, -1)),
        pb.Tensor("finish_reason", np.array([reasons], dtype=np.object_)),
        pb.Tensor("num_input_tokens", np.array([[state.final.num_prompt_tokens]], dtype=np.int32)),
        pb.Tensor("num_cached_tokens", np.array([[state.final.num_cached_tokens]], dtype=np.int32)),
        pb.Tensor("num_output_tokens", np.array([counts], dtype=np.int32)),
        pb.Tensor("sequence_index", np.arange(n, dtype=np.int32).reshape(1, n)),
    ]
    if state.returns.cumulative_logprob or state.wants_logprobs:
        tensors.append(pb.Tensor("cumulative_logprob", np.array([cumulative], dtype=np.float32)))
    if state.returns.logprobs:
        tensors.append(pb.Tensor("logprobs", np.array([logprobs], dtype=np.object_)))
    sender.send(pb.InferenceResponse(output_tensors=tensors), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return True
