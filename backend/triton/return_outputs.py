"""The outputs that Triton's vLLM backend returns on request (its ``return_*`` inputs), in its form.

Clients written for that backend (and Triton's OpenAI frontend) ask for them per request:

- ``return_finish_reason``: ``finish_reason`` on every response, "None" until the last one, then
  vLLM's reason ("stop" for EOS and stop conditions, "length", "abort").
- ``return_num_input_tokens``: ``num_input_tokens`` on every response. ``num_cached_tokens`` (our
  output: the prompt tokens whose KV was found in the prefix cache, an offload tier or a prefill
  engine when the request was first scheduled; 0 before then) goes wherever ``num_input_tokens`` does.
- ``return_num_output_tokens``: ``num_output_tokens`` on every response: the tokens *of that
  response* (the OpenAI frontend sums them for its usage block).
- ``return_cumulative_logprob``: ``cumulative_logprob``, the sum of the chosen tokens' logprobs so far.
- ``return_logprobs``: ``logprobs``, a JSON array with one object per new token,
  ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the chosen token and the request's
  top tokens (sampling_parameters ``logprobs: k``); the string "null" when the request asked for
  no logprobs.

Whenever ``sampling_parameters.logprobs`` is set (TensorRT-LLM's ``return_log_probs`` outputs, with
or without the flags): ``output_log_probs`` (FP32 [1, tokens of the response], the chosen tokens'),
with ``logprobs: k > 0`` also ``top_logprobs`` (BYTES [1, 1]: JSON, per token of the response a
list of the k best ``{"token_id", "text", "logprob"}``), and ``cumulative_logprob`` on the final
response. They come from the sampler's final distribution (backend/runner/sampler.py: after penalties,
masks and temperature; for greedy requests the log-softmax of the penalised logits), the
distribution the token was actually drawn from.

Without the flags, responses keep our own schema: finish_reason empty until the final response
(which names ``eos`` apart from ``stop``), and the counts, as totals, on the final response only.
"""

from __future__ import annotations

import json

import numpy as np

from backend.protocol.outputs import FinishReason, RequestOutput
from backend.triton.helpers import build_response
from backend.triton.inputs import ReturnOptions

VLLM_FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                       FinishReason.ABORT: "abort"}


def finish_reason_text(returns: ReturnOptions, final: RequestOutput | None) -> str:
    reason = final.finish_reason if final is not None else None
    if not returns.finish_reason:
        return reason.value if reason is not None else ""
    if reason is None:
        return "None"  # str(None), as vLLM's backend sends before the end
    return VLLM_FINISH_REASONS.get(reason, reason.value)


def token_counts(returns: ReturnOptions, output: RequestOutput, num_new_tokens: int,
                 final: RequestOutput | None) -> tuple[int | None, int | None]:
    """(num_input_tokens, num_output_tokens) for one response; None leaves the tensor out."""
    num_input = output.num_prompt_tokens if (returns.num_input_tokens or final is not None) else None
    if returns.num_output_tokens:
        num_output = num_new_tokens
    else:
        num_output = final.num_output_tokens if final is not None else None
    return num_input, num_output


def logprob_entries(tokenizer, outputs: list[RequestOutput]) -> list[dict]:
    """vLLM's per-token logprobs objects for the tokens of ``outputs`` (in order)."""
    entries = []
    for output in outputs:
        if not output.logprobs:
            continue
        ranks = output.logprob_ranks or [0] * len(output.logprobs)
        tops = output.top_logprobs or [[] for _ in output.logprobs]
        for token_id, logprob, rank, top in zip(output.new_token_ids, output.logprobs, ranks, tops, strict=True):
            entry = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}}
            for position, (top_id, top_logprob) in enumerate(top, start=1):
                entry.setdefault(str(top_id), {"logprob": top_logprob, "rank": position,
                                               "decoded_token": tokenizer.decode([top_id])})
            entries.append(entry)
    return entries


def extra_tensors(pb, returns: ReturnOptions, wants_logprobs: bool, cumulative_logprob: float,
                  logprobs: list[dict]) -> list:
    tensors = []
    if returns.cumulative_logprob:
        tensors.append(pb.Tensor("cumulative_logprob", np.array([[cumulative_logprob]], dtype=np.float32)))
    if returns.logprobs:
        text = json.dumps(logprobs) if wants_logprobs else "null"
        tensors.append(pb.Tensor("logprobs", np.array([[text.encode("utf-8")]], dtype=np.object_)))
    return tensors


def log_prob_tensors(pb, tokenizer, outputs: list[RequestOutput], final: RequestOutput | None,
                     cumulative_logprob: float, returns: ReturnOptions) -> list:
    """``output_log_probs``, ``top_logprobs`` and (final, unless the flag sends it on every
    response) ``cumulative_logprob`` of a request that asked for logprobs (module docstring)."""
    chosen = [value for output in outputs for value in (output.logprobs or ())]
    tensors = [pb.Tensor("output_log_probs", np.array([chosen], dtype=np.float32).reshape(1, -1))]
    tops = [top for output in outputs if output.logprobs for top in (output.top_logprobs or [[]] * len(output.logprobs))]
    if any(tops):
        table = [[{"token_id": token_id, "text": tokenizer.decode([token_id]) if tokenizer is not None else None,
                   "logprob": logprob} for token_id, logprob in top] for top in tops]
        tensors.append(pb.Tensor("top_logprobs", np.array([[json.dumps(table).encode("utf-8")]], dtype=np.object_)))
    if final is not None and not returns.cumulative_logprob:
        tensors.append(pb.Tensor("cumulative_logprob", np.array([[cumulative_logprob]], dtype=np.float32)))
    return tensors


def delta_text(state, part, outputs: list[RequestOutput]) -> tuple[str, list[int]]:
    """The text and token ids of ``outputs``, the prompt's first on ``part``'s first response when
    the request wants it (``exclude_input_in_output`` false). ``state`` is the request's
    ResponseState; ``part`` keeps ``prompt_sent``: the ResponseState itself, or one sample's
    SampleState (backend/triton/sequence_responses.py)."""
    text = "".join(o.text for o in outputs)
    token_ids = [t for o in outputs for t in o.new_token_ids]
    if not state.exclude_input_in_output and not part.prompt_sent:
        part.prompt_sent = True
        text = state.prompt + text
        token_ids = list(state.prompt_token_ids or []) + token_ids
    return text, token_ids


def delta_response(pb, state, part, outputs: list[RequestOutput], final: RequestOutput | None, tokenizer,
                   extra=()):
    """One `llm` response with ``outputs`` (of the request, or of one sample: see delta_text):
    text and ids, the token counts, the asked-for logprob tensors from ``part``'s cumulative
    logprob, then ``extra``; ``final`` is the part's last output once it ended."""
    text, token_ids = delta_text(state, part, outputs)
    returns = state.returns
    num_input, num_output = token_counts(returns, outputs[-1], sum(len(o.new_token_ids) for o in outputs), final)
    entries = logprob_entries(tokenizer, outputs) if returns.logprobs else []
    tensors = extra_tensors(pb, returns, state.wants_logprobs, part.cumulative_logprob, entries)
    if state.wants_logprobs:
        tensors.extend(log_prob_tensors(pb, tokenizer, outputs, final, part.cumulative_logprob, returns))
    tensors.extend(extra)
    num_cached = outputs[-1].num_cached_tokens if num_input is not None else None
    return build_response(pb, text, token_ids, finish_reason_text(returns, final), num_input, num_output, tensors,
                          state.requested_outputs, num_cached)
