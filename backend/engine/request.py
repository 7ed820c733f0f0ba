"""A generation request, its sampling parameters and its life-cycle status.

vLLM v1 vocabulary: a request has ``all_token_ids`` (prompt + output); the scheduler advances
``num_computed_tokens`` towards ``num_tokens`` under one token budget, with no prefill or decode
phases. A chunk of a prompt is just fewer tokens scheduled this step.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.kv_transfer.params import KVTransferParams
from backend.structured_output.spec import StructuredOutputSpec

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


class FinishReason(enum.StrEnum):
    """Values of the ``finish_reason`` output tensor."""

    LENGTH = "length"
    STOP = "stop"  # a stop string or stop token id
    EOS = "eos"
    ABORT = "abort"
    ERROR = "error"


# Bounds on stop conditions (each stop string is matched against every new piece of text).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_BYTES = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_N = 16  # parallel samples of one request
MAX_USER_CHARS = 256  # a client identity (OpenAI's user field); longer ones are refused
MAX_BEAM_WIDTH = 8
EARLY_STOPPING_VALUES = (False, True, "never")  # transformers' values


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM names). temperature 0 means greedy."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop token ids are ignored before this many outputs
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability (and rank) of each chosen token
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each step (vLLM's logprobs=k)
    skip_special_tokens: bool = True  # leave special tokens out of the text (vLLM's default)
    structured_outputs: StructuredOutputSpec | None = None  # constrain the output (backend/structured_output)
    priority: int = 0  # with scheduling_policy priority: lower runs first (vLLM's convention)
    prompt_logprobs: int | None = None  # 0: the logprob of every prompt token given the ones before it (vLLM's key)
    n: int = 1  # parallel samples (TensorRT-LLM: num_return_sequences); sample i > 0 is seeded seed + i
    beam_width: int = 1  # > 1: beam search (backend/engine/beam_search.py), returning the best n beams
    length_penalty: float = 1.0  # beam search: a hypothesis scores sum logprob / length ** this
    early_stopping: bool | str = False  # beam search: True, False or "never", as transformers
    num_speculative_tokens: int | None = None  # speculative decoding: at most this many per step; 0: off; None: config's
    user: str = ""  # the client that sent it (OpenAI's user): the key of per-client limits; "": the shared key
    lora_name: str | None = None  # the LoRA adapter (backend/lora), checked against the model's at the door
    kv_transfer_params: KVTransferParams | None = None  # disaggregated serving (backend/kv_transfer/params.py)

    def validate(self) -> None:
        """Raises SamplingParamsError naming the first bad field.

        Where Triton's input (TensorRT-LLM's name) and vLLM's key differ, the message names both
        (``min_length/min_tokens``, ``random_seed/seed``): the same text reaches every client.
        """
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise SamplingParamsError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise SamplingParamsError(f"min_length/min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_length/min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise SamplingParamsError(f"random_seed/seed must be in [0, 2**64), got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(f"logprobs: at most {MAX_TOP_LOGPROBS} top logprobs, got {self.top_logprobs}")
        if not isinstance(self.priority, int) or not -(2**31) <= self.priority < 2**31:
            raise SamplingParamsError(f"priority must be a 32-bit integer, got {self.priority!r}")
        if not isinstance(self.user, str) or len(self.user) > MAX_USER_CHARS:
            raise SamplingParamsError(f"user must be a string of at most {MAX_USER_CHARS} characters")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n/num_return_sequences must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise SamplingParamsError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if self.beam_width > 1:
            self._validate_beam_search()
        elif self.n > 1 and self.structured_outputs is not None:
            raise SamplingParamsError("n/num_return_sequences: more than one sample of a structured_outputs "
                                      "request is not supported")
        if self.kv_transfer_params is not None and (self.n > 1 or self.beam_width > 1):
            raise SamplingParamsError("kv_transfer_params: a disaggregated request has one sequence (n and "
                                      "beam_width 1)")
        if self.num_speculative_tokens is not None and (
                not isinstance(self.num_speculative_tokens, int) or not 0 <= self.num_speculative_tokens <= 16):
            raise SamplingParamsError(
                f"num_speculative_tokens must be an integer in [0, 16] (0 turns speculation off), "
                f"got {self.num_speculative_tokens!r}")
        if self.prompt_logprobs not in (None, 0):
            raise SamplingParamsError(
                f"prompt_logprobs: only 0 (each prompt token's own logprob) is supported, got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max((len(s.encode("utf-8")) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_BYTES:
            raise SamplingParamsError(f"stop: a stop string is {longest} bytes; at most {MAX_STOP_STRING_BYTES}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )

    def _validate_beam_search(self) -> None:
        """Beam search is deterministic and scores raw log-probabilities: sampling settings,
        penalties and per-token outputs do not apply to it; each is refused by name."""
        if self.n > self.beam_width:
            raise SamplingParamsError(f"n/num_return_sequences ({self.n}) must be <= beam_width ({self.beam_width})")
        if not math.isfinite(self.length_penalty):
            raise SamplingParamsError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.early_stopping not in EARLY_STOPPING_VALUES or isinstance(self.early_stopping, int) and not isinstance(
                self.early_stopping, bool):
            raise SamplingParamsError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        for name, default in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("min_tokens", 0), ("seed", None)):
            if getattr(self, name) != default:
                raise SamplingParamsError(f"{name}: does not apply to beam search (beam_width {self.beam_width})")
        for name, value in (("stop", self.stop), ("logprobs", self.logprobs), ("structured_outputs", self.structured_outputs),
                            ("prompt_logprobs", self.prompt_logprobs is not None)):
            if value:
                raise SamplingParamsError(f"{name}: not supported with beam search (beam_width {self.beam_width})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
