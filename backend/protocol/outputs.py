"""What the engine core returns across the process boundary: per-request outputs and their finish
reasons, the engine's statistics, and offline results. Read by Triton's stub processes and the
OpenAI front's shapes, which never load torch: plain dataclasses of plain values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Values of the ``finish_reason`` output tensor."""

    LENGTH = "length"
    STOP = "stop"  # a stop string or stop token id
    EOS = "eos"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the new text (a delta); on the final output also any held-back text
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[float] | None = None  # of new_token_ids, when the request asked for logprobs
    logprob_ranks: list[int] | None = None  # of new_token_ids (1 = the most likely token)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (token id, logprob) x top_logprobs
    prompt_logprobs: list[float] | None = None  # with prompt_logprobs, on the first output: of prompt tokens 1..n-1
    arrival_time: float = 0.0
    sequence_index: int = 0  # which sample of an n > 1 request (backend/engine/sequence_group.py)
    sequence_finished: bool = False  # this sample's last output (``finished``: the whole request's)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_transfer_params: dict | None = None  # a prefill engine's final output: where to pull its KV (vLLM's keys)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks referenced by requests
    num_kv_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    grammar_compiles: int = 0  # structured-output constraints compiled (cache misses)
    grammar_cache_hits: int = 0  # constrained requests whose grammar was compiled (or compiling) already
    grammar_compile_seconds: list[float] = field(default_factory=list)  # compiles finished since the last stats()
    # The KV offload tier (backend/kv_cache/offload/offloader.py: OffloadStats), cumulative:
    kv_shared_blocks: int = 0  # blocks saved by sharing (prefix hits, forked samples): references beyond the first
    kv_offload_stored_blocks: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_restored_blocks: int = 0
    kv_offload_restored_bytes: int = 0
    kv_offload_hits: int = 0  # blocks
    kv_offload_misses: int = 0  # blocks
    kv_offload_recomputed_blocks: int = 0  # in the tier, recomputed by the cost rule's choice
    kv_offload_dropped_blocks: int = 0  # the write queue was full
    kv_offload_load_seconds: list[float] = field(default_factory=list)  # loads finished since the last stats()
    # KV-cache events (backend/kv_cache/event_publisher.py: PublisherStats), cumulative:
    kv_events_published_batches: int = 0
    kv_events_dropped_batches: int = 0  # the publisher's queue was full
    # Disaggregated serving (backend/kv_transfer: ServerStats on a prefill engine, PullStats on a decode one):
    kv_transfer_pinned_blocks: int = 0  # now: blocks kept for a decode engine's pull
    kv_transfer_pinned_requests: int = 0
    kv_transfer_served_pulls: int = 0
    kv_transfer_sent_blocks: int = 0
    kv_transfer_sent_bytes: int = 0
    kv_transfer_refused_pulls: int = 0
    kv_transfer_expired_pins: int = 0
    kv_transfer_reclaimed_pins: int = 0
    kv_transfer_pulls: int = 0
    kv_transfer_received_blocks: int = 0
    kv_transfer_received_bytes: int = 0
    kv_transfer_fallbacks: int = 0
    kv_transfer_pull_seconds: list[float] = field(default_factory=list)  # pulls finished since the last stats()
    # LoRA adapters (backend/lora/manager.py):
    lora_loads: int = 0  # adapters loaded from their folders (cumulative)
    lora_load_seconds: list[float] = field(default_factory=list)  # loads since the last stats()
    lora_requests: dict[str, int] = field(default_factory=dict)  # adapter -> requests added (cumulative)
    lora_loaded: int = 0  # adapters in memory now
    lora_running: list[str] = field(default_factory=list)  # adapters of running requests now
    lora_waiting: list[str] = field(default_factory=list)  # adapters of waiting requests now
    lora_max: int = 0  # max_loras
    # Speculative decoding (backend/spec_decode/speculator.py: SpecDecodeStats), cumulative:
    spec_decode_num_draft_tokens: int = 0  # proposals verified
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = field(default_factory=list)  # [k]: proposal i accepted
    spec_decode_num_steps: int = 0  # steps with a request that could speculate
    spec_decode_num_speculated_steps: int = 0  # of those, the steps the controller let speculate
    # The CPU thread governor (backend/engine/cpu_threads.py); 0 and 0 when the thread count is fixed:
    cpu_threads: int = 0  # torch threads now
    cpu_thread_reductions: int = 0  # times they were cut for want of CPU (cumulative)


@dataclass(slots=True)
class GenerationResult:
    """The whole result of one request from ``generate()``."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # with prompt_logprobs: of prompt tokens 1..n-1
    samples: list[GenerationResult] = field(default_factory=list)  # all n samples (this one first)
