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

from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams

if TYPE_CHECKING:  # annotations only: this module stays importable without torch
    import torch

    from backend.engine.beam_group import BeamGroup
    from backend.engine.detokenizer import IncrementalDetokenizer
    from backend.engine.sequence_group import SequenceGroup
    from backend.kv_cache.block_pool import BlockHash
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
class Request:
    """One generation request and everything the engine keeps for it.

    The engine's per-request state lives here and nowhere else: its tokens and progress, its
    detokenizer, its seeded sampling generator, its block hashes for the prefix cache. Finishing a
    request drops it, and all of that with it; only its KV blocks (the KV manager's block table)
    are freed explicitly, by the scheduler.
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
    output_logprobs: list[float] = field(default_factory=list)
    output_logprob_ranks: list[int] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    detokenizer: IncrementalDetokenizer | None = None  # set by the engine when it accepts the request
    generator: torch.Generator | None = None  # of a seeded request, made by the sampler on first use
    block_hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks (tokens never change)
    # What the first block chains to: None for the base model; a LoRA adapter's own root
    # (backend/lora/manager.py), so no cached block is shared across adapters.
    block_hash_root: BlockHash | None = None
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache (0 again after a free)
    grammar: RequestGrammar | None = None  # of a constrained request (backend/structured_output)
    # With prompt_logprobs: entry i is log P(prompt token i + 1 | prompt tokens 0..i), filled chunk by chunk.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Parallel sampling (n > 1): the request's samples share one SequenceGroup; this is sample
    # ``sequence_index`` of it (sample 0 computes the prompt, the others fork its blocks).
    group: SequenceGroup | None = None
    sequence_index: int = 0
    beam: BeamGroup | None = None  # this request is one running beam of it
    # Speculative decoding (backend/spec_decode): this step's proposed tokens, verified after the
    # known ones in the same forward; with a draft model's sampled proposals, their distributions.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab]; None: point masses
    # Disaggregated serving (backend/kv_transfer): a prefill engine's transfer parameters for the
    # final answer; on a decode engine, whether the prompt's pull was already done (once per request).
    kv_transfer_result: dict | None = None
    kv_pull_done: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def child(self, request_id: str, sampling_params: SamplingParams) -> Request:
        """A request that continues this one from its tokens so far (a forked sample or beam): same
        prompt, tokens and timings; the scheduler shares its KV blocks (``Scheduler.add_forked``)."""
        child = Request(request_id, list(self.prompt_token_ids), sampling_params, eos_token_id=self.eos_token_id,
                        arrival_time=self.arrival_time)
        child.block_hash_root = self.block_hash_root
        child.all_token_ids = list(self.all_token_ids)
        child.first_scheduled_time, child.num_cached_tokens = self.first_scheduled_time, self.num_cached_tokens
        return child
