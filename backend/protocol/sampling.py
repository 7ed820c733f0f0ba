"""A request's sampling parameters (vLLM's names), checked in one place: ``SamplingParams.validate``.

Every door (the Triton stub's inputs, the OpenAI front's fields through them, the offline
``generate``) builds one and the engine core receives it in ``AddRequest`` (backend/protocol/messages.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from backend.protocol.kv_transfer import KVTransferParams
from backend.protocol.structured_output import StructuredOutputSpec

# Bounds on stop conditions (each stop string is matched against every new piece of text).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_BYTES = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_N = 16  # parallel samples of one request
MAX_USER_CHARS = 256  # a client identity (OpenAI's user field); longer ones are refused
MAX_BEAM_WIDTH = 8
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound on logit_bias
MAX_LOGIT_BIAS = 100.0  # a bias is in [-100, 100] (OpenAI's)
EARLY_STOPPING_VALUES = (False, True, "never")  # transformers' values


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM names). temperature 0 means greedy."""

    max_tokens: int | None = None  # None: the model's default_max_tokens, filled in by the one check (InputProcessor)
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
    kv_transfer_params: KVTransferParams | None = None  # disaggregated serving (backend/protocol/kv_transfer.py)
    # token id -> added to its logit before anything else (OpenAI's; -100 bans it, 100 all but forces it)
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self) -> None:
        """Raises SamplingParamsError naming the first bad field.

        Where Triton's input (TensorRT-LLM's name) and vLLM's key differ, the message names both
        (``min_length/min_tokens``, ``random_seed/seed``): the same text reaches every client.
        """
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise SamplingParamsError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise SamplingParamsError(f"min_length/min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
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
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        """At most MAX_LOGIT_BIAS_ENTRIES ids, each a non-negative integer (the vocabulary is the
        engine's check), each bias a number in [-100, 100]."""
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(f"logit_bias: an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids")
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise SamplingParamsError(f"logit_bias: {token_id!r} is not a token id")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not (
                    math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise SamplingParamsError(f"logit_bias[{token_id}]: a bias must be in [-100, 100], got {bias!r}")

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
                            ("prompt_logprobs", self.prompt_logprobs is not None), ("logit_bias", self.logit_bias)):
            if value:
                raise SamplingParamsError(f"{name}: not supported with beam search (beam_width {self.beam_width})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
