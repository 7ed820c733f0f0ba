"""What one engine step returns to its caller: the step's outputs and statistics (engine-internal;
the per-request outputs themselves are backend/protocol/outputs.py's)."""

from __future__ import annotations

from dataclasses import dataclass

from backend.protocol.outputs import RequestOutput


@dataclass(slots=True)
class StepStats:
    """What one step did (vLLM returns scheduler statistics with every step, too)."""

    num_seqs: int = 0  # requests scheduled
    num_prefill_tokens: int = 0  # tokens of prompt chunks (and of preempted requests recomputing)
    num_decode_tokens: int = 0  # one per request decoding its next token
    num_preempted: int = 0  # requests preempted to make room (now waiting again)
    num_sampled: int = 0  # requests that got a token
    num_spec_tokens: int = 0  # proposed tokens verified in this step (counted in num_decode_tokens)
    timings: dict[str, float] | None = None  # seconds per phase, when step(timings=True)


@dataclass(slots=True)
class StepOutput:
    outputs: list[RequestOutput]
    stats: StepStats
