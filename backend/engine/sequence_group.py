"""The samples of one request with ``n > 1`` (parallel sampling), as PagedAttention shares them.

Sample 0 is an ordinary request: it is scheduled, its prompt is computed once. In the step that
samples its first token, the engine forks samples 1..n-1 from it: each takes all of its blocks
(reference counts raised, backend/kv_cache/manager.py ``fork``) and its own first token from
the same logits row, and then runs as a request of its own; the first to append to the shared
partial last block copies it (copy-on-write). Sample ``i`` of a seeded request uses the seed
``seed + i`` (sample 0 the request's seed itself), so every sample is reproducible whatever
else is in the batch, and the first sample equals the same request with ``n = 1``.

Every output names the client's request id and its ``sequence_index``; ``finished`` marks the
last output of the whole request (after every sample ended), ``sequence_finished`` the last of a
sample. An abort or an error ends every sample at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.engine.request import Request


@dataclass(slots=True, eq=False)
class SequenceGroup:
    request_id: str  # the client's
    n: int
    sequences: list[Request] = field(default_factory=list)  # by sequence_index
    forked: bool = False
    num_finished: int = 0
    finished: bool = False  # every sample ended, or the request was aborted or failed

    def unfinished(self) -> list[Request]:
        return [s for s in self.sequences if not s.is_finished]
