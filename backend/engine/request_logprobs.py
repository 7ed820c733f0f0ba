"""The logprobs one request has gathered so far, when its sampling parameters ask for them. The
output processor alone writes it (from the sampler's and the runner's values) and reads it back
into each output."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestLogprobs:
    output: list[float] = field(default_factory=list)  # each sampled token's logprob
    output_ranks: list[int] = field(default_factory=list)  # its rank in the processed distribution
    output_top: list[list[tuple[int, float]]] = field(default_factory=list)  # the top-k (token, logprob) pairs
    # With prompt_logprobs: entry i is log P(prompt token i + 1 | prompt tokens 0..i), filled chunk by chunk.
    prompt: list[float] = field(default_factory=list)
    prompt_sent: bool = False  # prompt logprobs go out once, with the first output that has tokens
