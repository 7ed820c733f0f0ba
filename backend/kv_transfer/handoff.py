"""The KV-transfer feature's record on each request: what a prefill engine answers about a finished
prompt whose KV it keeps for a decode engine's pull. Only backend/kv_transfer writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from backend.kv_cache.request_view import RequestBlocks
from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams


@dataclass(slots=True)
class Handoff:
    params: dict | None = None  # vLLM's kv_transfer_params of the final answer (remote engine, blocks, ...)


class FinishedPrompt(Protocol):
    """What the transfer server reads of a finished request (the engine's Request)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # reads kv_transfer_params
    finish_reason: FinishReason | None
    kv: RequestBlocks  # reads hash_root
    kv_transfer: Handoff

    @property
    def num_prompt_tokens(self) -> int: ...
