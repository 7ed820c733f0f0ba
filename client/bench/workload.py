"""The requests of one benchmark run: prompts of exact token counts and forced output lengths.

Plain workloads sample each request's prompt length from one distribution. Shared-prefix
workloads make ``num_prefixes`` system prompts of ``prefix_len`` tokens; each request takes one
(seeded choice) followed by a unique suffix whose length comes from the input distribution, so the
request's input is prefix_len + suffix tokens. Output lengths are forced by the client (max_tokens
with ignore_eos). Lengths are clipped so prompt + output fits ``max_model_len``.

The same workload runs an engine in-process as token ids (``token_requests``): every benchmark,
served or not, draws its prompts here, from the model's own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from client.bench.lengths import LengthDistribution
from client.bench.prompts import PromptBuilder

RUN_SEED_STRIDE = 1_000_003  # run i of a sweep uses seed + i * stride: distinct prompts per run


@dataclass(frozen=True, slots=True)
class WorkItem:
    prompt: str
    num_input_tokens: int  # as the server counts them (special tokens included)
    max_tokens: int  # forced output length (sent with ignore_eos=true)
    prefix_index: int | None = None  # which shared system prompt, if any
    # Other `llm` inputs (client.stream.build_inputs names: messages, sampling_parameters...) sent
    # instead of ignore_eos=true; then the output ends where the model or its constraint ends it.
    inputs: dict | None = None


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    num_prefixes: int
    prefix_len: int  # tokens, special tokens included


def build_workload(
    builder: PromptBuilder,
    num_requests: int,
    input_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    seed: int,
    shared_prefix: SharedPrefix | None = None,
    max_model_len: int | None = None,
) -> list[WorkItem]:
    """``num_requests`` items, the same for the same seed and tokenizer."""
    rng = np.random.default_rng(seed)
    suffix_lens = input_lengths.sample(rng, num_requests)
    output_lens = output_lengths.sample(rng, num_requests)
    prefixes: list[str] = []
    prefix_choice = [None] * num_requests
    if shared_prefix is not None and shared_prefix.num_prefixes > 0:
        prefixes = [builder.prompt(shared_prefix.prefix_len, rng) for _ in range(shared_prefix.num_prefixes)]
        prefix_choice = rng.integers(0, shared_prefix.num_prefixes, size=num_requests).tolist()
    items = []
    for suffix_len, output_len, prefix_index in zip(suffix_lens, output_lens, prefix_choice, strict=True):
        if prefix_index is None:
            num_input = suffix_len
            if max_model_len is not None:
                num_input = min(num_input, max_model_len - 1)
            num_input = max(num_input, builder.num_special_tokens + 1)
            prompt = builder.prompt(num_input, rng)
        else:
            if max_model_len is not None:
                suffix_len = max(1, min(suffix_len, max_model_len - 1 - shared_prefix.prefix_len))
            prompt = builder.prompt_after_prefix(prefixes[prefix_index], suffix_len, rng)
            num_input = shared_prefix.prefix_len + suffix_len
        if max_model_len is not None:
            output_len = max(1, min(output_len, max_model_len - num_input))
        items.append(WorkItem(prompt, num_input, int(output_len), prefix_index))
    return items


def token_requests(builder: PromptBuilder, items: list[WorkItem]) -> list[tuple[list[int], int]]:
    """``items`` as an engine in-process takes them: (prompt token ids, as the server counts them,
    forced output tokens) each."""
    requests = []
    for item in items:
        ids = builder.tokenizer.encode(item.prompt, add_special_tokens=True).ids
        if len(ids) != item.num_input_tokens:
            raise ValueError(f"a prompt of {item.num_input_tokens} tokens encodes to {len(ids)}")
        requests.append((ids, item.max_tokens))
    return requests
