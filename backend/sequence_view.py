"""What every layer below the engine may read of a request, and the token counts derived from its lists.

``SequenceView`` is the common part of the views the runner, the KV cache, speculation and the
transfer server declare (each adds what it alone reads, beside its own record); ``TokenCounts``
is the one definition of the counts, shared by the engine's ``Request`` and a draft model's
shadow sequences, so the two can never disagree on what a prompt or an output token is.
"""

from __future__ import annotations

from typing import Protocol

from backend.protocol.sampling import SamplingParams


class TokenCounts:
    """``num_prompt_tokens``, ``num_tokens`` and ``num_output_tokens`` of a class that holds
    ``prompt_token_ids`` and ``all_token_ids`` (prompt + output)."""

    __slots__ = ()
    prompt_token_ids: list[int]
    all_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class SequenceView(Protocol):
    """A request as any layer below the engine sees it: its id, its tokens and its parameters."""

    request_id: str
    all_token_ids: list[int]  # prompt + output
    sampling_params: SamplingParams

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...
