"""The KV-transfer feature's record on each request: what a prefill engine answers about a finished
prompt whose KV it keeps for a decode engine's pull. Only backend/kv_transfer writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from backend.kv_cache.request_view import RequestBlocks
from backend.protocol.outputs import FinishReason
from backend.sequence_view import SequenceView


@dataclass(slots=True)
class Handoff:
    params: dict | None = None  # vLLM's kv_transfer_params of the final answer (remote engine, blocks, ...)


class FinishedPrompt(SequenceView, Protocol):
    """What the transfer server reads of a finished request (the engine's Request); of its sampling
    parameters, kv_transfer_params."""

    prompt_token_ids: list[int]
    finish_reason: FinishReason | None
    kv: RequestBlocks  # reads hash_root
    kv_transfer: Handoff
