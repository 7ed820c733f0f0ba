"""A request's speculative proposals for this step: the speculation feature's record on each request,
written only by backend/spec_decode (the speculator proposes and clears it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from backend.runner.scheduled import RunnerRequest

if TYPE_CHECKING:  # annotations only: the engine's request module stays importable without torch
    import torch


@dataclass(slots=True)
class Proposal:
    """Proposed tokens, verified after the known ones in the same forward; with a draft model's
    sampled proposals, the distributions they were drawn from (None: point masses)."""

    token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(token_ids), vocab]

    def clear(self) -> None:
        self.token_ids = []
        self.draft_probs = None


class SpeculatingRequest(RunnerRequest, Protocol):
    """What speculation reads of a request (the engine's Request); it writes only ``spec``."""

    num_computed_tokens: int
    grammar: object | None  # a constrained request never speculates
    spec: Proposal

    @property
    def is_running(self) -> bool: ...

    @property
    def is_beam(self) -> bool: ...
