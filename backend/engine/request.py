"""A generation request and its life-cycle status (its sampling parameters: backend/protocol/sampling.py).

vLLM v1 vocabulary: a request has ``all_token_ids`` (prompt + output); the scheduler advances
``num_computed_tokens`` towards ``num_tokens`` under one token budget, with no prefill or decode
phases. A chunk of a prompt is just fewer tokens scheduled this step.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.engine.fanout import Fanout
from backend.engine.request_logprobs import RequestLogprobs
from backend.kv_cache.request_view import RequestBlocks
from backend.kv_transfer.handoff import Handoff
from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams
from backend.sequence_view import TokenCounts
from backend.spec_decode.proposal import Proposal

if TYPE_CHECKING:  # annotations only: this module stays importable without torch
    import torch

    from backend.engine.detokenizer import IncrementalDetokenizer
    from backend.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV blocks freed (recompute)
    FINISHED_STOPPED = 3  # eos, stop token id or stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # cancelled by the client or the server
    FINISHED_ERROR = 6  # can never be scheduled (too long for the model or the pool)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


@dataclass(slots=True, eq=False)
class Request(TokenCounts):
    """One generation request: its identity, tokens, status and timing, and one record per feature.

    Each record belongs to the feature that alone writes it (backend/kv_cache: ``kv``; speculation:
    ``spec``; disaggregation: ``kv_transfer``; structured output: ``grammar``; the output processor:
    ``fanout`` for samples and beams, ``logprobs``); the others read it. Finishing a request drops
    it and all of that with it; only its KV blocks (the KV manager's block table) are freed
    explicitly, by the scheduler.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    all_token_ids: list[int] = field(init=False)  # prompt + output, appended as tokens are sampled
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled (later preemptions keep it)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why a FINISHED_ERROR request could not run
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    detokenizer: IncrementalDetokenizer | None = None  # set by the engine when it accepts the request
    generator: torch.Generator | None = None  # of a seeded request, made by the sampler on first use

    kv: RequestBlocks = field(default_factory=RequestBlocks)  # block hashes and the adapter's hash root
    spec: Proposal = field(default_factory=Proposal)  # this step's speculative proposals
    kv_transfer: Handoff = field(default_factory=Handoff)  # a prefill engine's answer for the decode engine
    grammar: RequestGrammar | None = None  # of a constrained request
    fanout: Fanout = field(default_factory=Fanout)  # n > 1 samples and beams
    logprobs: RequestLogprobs = field(default_factory=RequestLogprobs)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_running(self) -> bool:
        return self.status == RequestStatus.RUNNING

    @property
    def is_beam(self) -> bool:
        """One running beam of a beam search (scored by the search, never sampled or speculated)."""
        return self.fanout.beam is not None

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def child(self, request_id: str, sampling_params: SamplingParams) -> Request:
        """A request that continues this one from its tokens so far (a forked sample or beam): same
        prompt, tokens and timings; the scheduler shares its KV blocks and their record (``Scheduler.add_forked``)."""
        child = Request(request_id, list(self.prompt_token_ids), sampling_params, eos_token_id=self.eos_token_id,
                        arrival_time=self.arrival_time, kv=RequestBlocks(hash_root=self.kv.hash_root))
        child.all_token_ids = list(self.all_token_ids)
        child.first_scheduled_time, child.num_cached_tokens = self.first_scheduled_time, self.num_cached_tokens
        return child
