"""The engine's side of one beam-search request: which requests hold which running beam.

Each running beam is an engine request of its own (its tokens, its block table). A beam step
(backend/engine/beam_search.py) needs the next-token log-probabilities of every running beam, so rows
are kept here as their beams compute them (a preempted beam recomputes and brings its row later)
and the step runs once all are in. Then new beam j continues old beam ``parents[j]``: the first
new beam of a parent takes over its request, each further one forks it (its blocks shared,
copy-on-write), and beams no new beam continues are finished (their blocks freed). Nothing is
streamed: the best ``n`` hypotheses go out when the search ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from backend.engine.beam_search import BeamSearch

if TYPE_CHECKING:
    from backend.engine.request import Request
    from backend.protocol.sampling import SamplingParams


@dataclass(slots=True, eq=False)
class BeamGroup:
    request_id: str  # the client's
    search: BeamSearch
    n: int  # hypotheses returned
    beams: list[Request | None] = field(default_factory=list)  # per running beam (None: not forked yet)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # running beam index -> [vocab] log-probs
    num_created: int = 1  # requests made for beams so far (for their ids)
    finished: bool = False

    @classmethod
    def start(cls, request: Request, params: SamplingParams) -> BeamGroup:
        """The group of a new beam-search request: ``request`` is beam 0, the others fork from it
        at its first token."""
        eos = () if params.ignore_eos or request.eos_token_id is None else (request.eos_token_id,)
        search = BeamSearch(params.beam_width, params.max_tokens, tuple(dict.fromkeys((*eos, *params.stop_token_ids))),
                            params.length_penalty, params.early_stopping)
        return cls(request.request_id, search, params.n, [request] + [None] * (params.beam_width - 1))

    @property
    def first_step(self) -> bool:
        return self.search.num_generated == 0

    def needed(self) -> int:
        """Rows the next step waits for: beam 0 alone at first (the others are its copies)."""
        return 1 if self.first_step else self.search.beam_width

    def has_row(self, request: Request) -> bool:
        """Whether ``request`` (one of the running beams) brought its row for the next step."""
        return any(beam is request for beam in self.beams) and self.beams.index(request) in self.rows

    def ready(self) -> bool:
        return len(self.rows) >= self.needed()

    def log_probs(self) -> torch.Tensor:
        """[beam_width, vocab] in running-beam order (the first step repeats beam 0's row)."""
        if self.first_step:
            return self.rows[0].unsqueeze(0).expand(self.search.beam_width, -1)
        return torch.stack([self.rows[i] for i in range(self.search.beam_width)])
