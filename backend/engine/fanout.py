"""A request's place among its siblings: one sample of an n > 1 request (SequenceGroup) or one
running beam (BeamGroup). The output processor, which forks samples and beams, alone writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.engine.beam_group import BeamGroup
    from backend.engine.sequence_group import SequenceGroup


@dataclass(slots=True)
class Fanout:
    group: SequenceGroup | None = None  # the samples of an n > 1 request; this is sample ``sequence_index``
    sequence_index: int = 0  # sample 0 computes the prompt, the others fork its blocks
    beam: BeamGroup | None = None  # this request is one running beam of it
