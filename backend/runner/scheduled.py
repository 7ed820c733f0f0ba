"""The runner's input: what one step computes of each request, and what it reads of the request.

The engine's scheduler makes these for the requests it scheduled; a draft model (backend/spec_decode)
for its shadow sequences, and the speculator's start-up timer for made-up ones. Each of those only
has to look like ``RunnerRequest``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from backend.sequence_view import SequenceView

if TYPE_CHECKING:  # annotations only: the scheduler imports this module and stays importable without torch
    import torch


class RunnerRequest(SequenceView, Protocol):
    """What the model runner and the sampler read of a request (the engine's Request among others)."""

    eos_token_id: int | None  # min_tokens masks it
    generator: torch.Generator | None  # a seeded request's, made by the sampler on first use


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``num_computed_tokens .. + num_new_tokens - 1``."""

    request: RunnerRequest
    num_new_tokens: int
    num_computed_tokens: int  # snapshot BEFORE this step (the request's counter is already advanced)
    block_ids: list[int]  # the whole block table after this step's allocation
    # Proposed tokens after the known ones (speculative decoding): part of num_new_tokens, their
    # KV written this step and rolled back by the engine for those the target rejects.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def is_last_chunk(self) -> bool:
        """True when this step reaches the end of the known tokens: the engine samples then."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens + len(self.spec_token_ids)
