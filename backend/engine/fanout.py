"""A request's place among its siblings: one sample of an n > 1 request (SequenceGroup) or one
running beam (BeamGroup). The output processor, which forks samples and beams, alone writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.engine.beam_group import BeamGroup
    from backend.engine.sequence_group import SequenceGroup


def forked_request_id(request_id: str, kind: str, index: int) -> str:
    """The engine's id of sample or beam ``index`` of a request (``kind``: "sample" or "beam"); the
    first keeps the client's id. The unit separator keeps a forked id apart from clients' ids."""
    return request_id if index == 0 else f"{request_id}\x1f{kind}{index}"


@dataclass(slots=True)
class Fanout:
    group: SequenceGroup | None = None  # the samples of an n > 1 request; this is sample ``sequence_index``
    sequence_index: int = 0  # sample 0 computes the prompt, the others fork its blocks
    beam: BeamGroup | None = None  # this request is one running beam of it
