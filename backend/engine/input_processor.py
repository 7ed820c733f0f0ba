"""What a request needs before the engine core sees it: its sampling check, its chat prompt, its token ids.

This runs in the front end (Triton's stub process) when the engine core has its own process, and
inside ``LLMEngine`` otherwise: one check, one chat rendering and one tokenization for both. It
needs the tokenizer and two numbers of the model (vocabulary size and max_model_len), not the model,
and the structured-output bounds to refuse a constraint over budget before it is ever compiled.
"""

from __future__ import annotations

from collections import OrderedDict

from backend.config import KVTransferConfig, SchedulerConfig, StructuredOutputConfig
from backend.lora.registry import AdapterRegistry, LoRAConfigError
from backend.protocol.kv_transfer import KVTransferParamsError, check_against
from backend.protocol.sampling import SamplingParams, SamplingParamsError
from backend.protocol.structured_output import StructuredOutputError, check_spec
from backend.structured_output.budget import check_budget

CHECKED_CONSTRAINTS = 256  # constraints remembered as valid, so a repeated schema is checked once


class EngineInputError(ValueError):
    """A request the engine cannot take; the message names the field."""


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 structured_output: StructuredOutputConfig | None = None,
                 kv_transfer: KVTransferConfig | None = None, lora: AdapterRegistry | None = None,
                 default_max_tokens: int = SchedulerConfig().default_max_tokens):
        """``structured_output``: the budget a constraint must fit (backend/structured_output/budget.py);
        None checks no budget here (the engine still does when the request is added). ``kv_transfer``:
        this engine's role in disaggregated serving and the peers it may pull from. ``lora``: the
        adapters it serves (None: none). ``default_max_tokens``: config.pbtxt's, for a request that names none."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured_output = structured_output
        self.kv_transfer = kv_transfer or KVTransferConfig()
        self._peers = self.kv_transfer.peers
        self.lora = lora
        self.default_max_tokens = default_max_tokens
        self._valid_constraints: OrderedDict[str, None] = OrderedDict()  # cache keys, LRU

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt of a chat: the checkpoint's chat template with the generation prompt added.

        Tokenize it with ``add_special_tokens=False`` (templates write their own BOS), as
        transformers' ``apply_chat_template(tokenize=True)`` and vLLM's chat endpoint do.
        Raises EngineInputError naming ``messages``.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineInputError("messages: this model has no chat template; send text_input instead")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may raise on role orders it does not support
            raise EngineInputError(f"messages: the chat template refused them ({type(exc).__name__}: {exc})") from None

    def apply_defaults(self, params: SamplingParams) -> None:
        """Fills in what the request left to the model (the one place a default is chosen)."""
        if params.max_tokens is None:
            params.max_tokens = self.default_max_tokens

    def check_token_ids(self, name: str, token_ids) -> None:
        """Every id of field ``name`` is one of the model's (EngineInputError naming the first that is not)."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise EngineInputError(f"{name}: {bad} is not a token id of this model (ids are in [0, {self.vocab_size}))")

    def check_sampling_params(self, params: SamplingParams) -> None:
        """The one check of a request's sampling parameters; raises EngineInputError naming the field.

        What depends on the prompt (its length against max_model_len and the KV pool) is checked
        by the engine once the request arrives (``LLMEngine.add_request``).
        """
        self.apply_defaults(params)
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise EngineInputError(str(exc)) from None
        if params.max_tokens >= self.max_model_len:
            raise EngineInputError(f"max_tokens: {params.max_tokens} is above the limit {self.max_model_len - 1}")
        if params.structured_outputs is not None:
            self._check_constraint(params)
        try:  # a pull goes only to a configured peer: checked before anything is contacted
            check_against(params.kv_transfer_params, self.kv_transfer.kv_role, self._peers)
        except KVTransferParamsError as exc:
            raise EngineInputError(str(exc)) from None
        if params.lora_name is not None:
            self.resolve_lora(params.lora_name)
        self.check_token_ids("logit_bias", params.logit_bias)
        self.check_token_ids("stop_token_ids", params.stop_token_ids)

    def resolve_lora(self, name: str | None, task_id: int | None = None) -> str | None:
        """The adapter a request names (``lora_name``, or TensorRT-LLM's ``lora_task_id``), None for the
        base model; EngineInputError naming the field for one this model does not serve. A name is
        only looked up in the adapter table: it never becomes a path."""
        if name is None and task_id is None:
            return None
        if self.lora is None:
            field = "lora_task_id" if task_id is not None else "lora_name"
            raise EngineInputError(f"{field}: this model serves no LoRA adapters (parameter enable_lora)")
        try:
            return self.lora.resolve(name, task_id)
        except LoRAConfigError as exc:
            raise EngineInputError(str(exc)) from None

    def _check_constraint(self, params: SamplingParams) -> None:
        """The constraint fits the budget, then compiles (tokenizer-free, about a millisecond); refused
        here, not in the step."""
        spec = params.structured_outputs
        key = spec.cache_key
        if key in self._valid_constraints:
            self._valid_constraints.move_to_end(key)
            return
        try:
            if self.structured_output is not None:
                check_budget(spec, self.structured_output)
            check_spec(spec)
        except StructuredOutputError as exc:
            raise EngineInputError(str(exc)) from None
        self._valid_constraints[key] = None
        if len(self._valid_constraints) > CHECKED_CONSTRAINTS:
            self._valid_constraints.popitem(last=False)
