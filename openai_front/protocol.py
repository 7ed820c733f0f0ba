"""OpenAI request bodies, checked field by field, as what the `llm` model takes.

A body becomes a GenerationRequest: the prompts (completions) or the messages (chat), and the
`llm` model's ``sampling_parameters`` in vLLM's names. Every problem is a 400 naming the field
(backend of the refusal: openai_front/errors.py): a wrong type, a value out of range, a field that
would change generation and that we do not implement (``tools``, ``suffix``,
``best_of`` above ``n``, ...), or a field we do not know at all. Fields that change nothing here
(``metadata``, ``store``, ...) are accepted and ignored, as OpenAI's server does; ``user`` names the
client for per-client limits. A
field left out keeps the `llm` model's default (no temperature: greedy, as SmolLM2's
generation_config.json asks with do_sample false).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openai_front.errors import bad_request

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "ignore_eos", "min_tokens", "priority", "stop_token_ids",
                   "skip_special_tokens")
STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_USER_CHARS = 256  # as the `llm` model's sampling_parameters.user
IGNORED_FIELDS = ("metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
                  "request_id")
COMMON_FIELDS = frozenset({"model", "stream", "max_tokens", "n", "stop", "best_of", "logit_bias", "response_format",
                           "user", "kv_transfer_params", *SAMPLING_FIELDS, *STRUCTURED_FIELDS, *IGNORED_FIELDS})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "include_reasoning",
                               "tool_choice", "functions", "function_call", "modalities", "audio",
                               "prediction", "reasoning_effort", "web_search_options", "add_generation_prompt"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"}
# Known fields that would change what is generated, and that we do not implement.
UNSUPPORTED = {"tools": "tool calling is not supported", "functions": "function calling is not supported",
               "function_call": "function calling is not supported", "suffix": "suffix is not supported",
               "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
               "web_search_options": "web search is not supported",
               "reasoning_effort": "reasoning_effort is not supported by this model"}
# vLLM's /tokenize fields that would change a chat's ids, and that the tokenizer model does not implement.
TOKENIZE_CHAT_UNSUPPORTED = ("continue_final_message", "chat_template", "chat_template_kwargs", "tools")
MAX_STOP_STRINGS = 32
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound, as the `llm` model's


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for (the front's command line)."""

    max_n: int = 8
    max_tokens: int = 8192


@dataclass(slots=True)
class GenerationRequest:
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    n: int
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: text or token ids, one generation each (x n)
    messages: list | None = None  # chat
    echo: bool = False
    logprobs: int | None = None  # top tokens per position to return (0: the chosen one only); None: none
    sampling: dict = field(default_factory=dict)  # the `llm` model's sampling_parameters (vLLM's names)
    stream_options: dict | None = None  # as sent (only with stream true)
    user: str = ""  # OpenAI's user field: the client's identity for per-client limits when no API key names one
    include_reasoning: bool = True  # chat, with a reasoning parser: false leaves the reasoning out of the answer
    reasoning_parser: str | None = None  # chat: the front's or the model's (openai_front/reasoning.py)


def _check_type(name: str, value, kinds: tuple[type, ...], label: str):
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(name, f"{name}: expected {label}, got a boolean")
    if not isinstance(value, kinds):
        raise bad_request(name, f"{name}: expected {label}, got {type(value).__name__}")
    return value


def _int(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    _check_type(name, value, (int,), "an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise bad_request(name, f"{name}: must be {bounds}, got {value}")
    return value


def _float(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    return float(_check_type(name, value, (int, float), "a number"))


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    return _check_type(name, value, (bool,), "a boolean")


def _stop(body: dict) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_request("stop", "stop: expected a string or a list of strings")
    if len(words) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"stop: at most {MAX_STOP_STRINGS} strings, got {len(words)}")
    return [w for w in words if w]


def _structured(body: dict) -> dict | None:
    """response_format and vLLM's structured_outputs / guided_* as the `llm` model's structured_outputs."""
    given = {}
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise bad_request("response_format", "response_format: expected an object with a type")
        kind = response_format["type"]
        if kind == "json_object":
            given["json_object"] = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise bad_request("response_format.json_schema.schema",
                                  "response_format.json_schema.schema: expected a JSON schema object")
            given["json"] = spec["schema"]
        elif kind != "text":
            raise bad_request("response_format.type",
                              f"response_format.type: one of text, json_object, json_schema, got {kind!r}")
    if body.get("structured_outputs") is not None:
        if not isinstance(body["structured_outputs"], dict):
            raise bad_request("structured_outputs", "structured_outputs: expected an object")
        given.update(body["structured_outputs"])
    for legacy in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if body.get(legacy) is not None:
            given[legacy.removeprefix("guided_")] = body[legacy]
    return given or None


def _check_fields(body: dict, known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise bad_request(name, f"{name}: unknown field")
    for name, reason in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise bad_request(name, f"{name}: {reason}")
    if body.get("tool_choice") not in (None, "none"):
        raise bad_request("tool_choice", "tool_choice: tool calling is not supported")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise bad_request("modalities", "modalities: only [\"text\"] is supported")


def _common(body, chat: bool, limits: Limits, served_models: tuple[str, ...]) -> GenerationRequest:
    """What chat and completions share: the body's shape, its field names, and the common fields."""
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "model: required, a string")
    if model not in served_models:
        raise bad_request("model", f"model: {model!r} is not served here (served: {', '.join(served_models)})",
                          "model_not_found")
    n = _int(body, "n", 1, limits.max_n) or 1
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != n and best_of != 1:
        raise bad_request("best_of", f"best_of: only best_of == n is supported, got {best_of} with n {n}")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage",
                                                                                  "continuous_usage_stats"}):
        raise bad_request("stream_options", "stream_options: expected {\"include_usage\": bool}")
    include_usage = bool((options or {}).get("include_usage"))
    if options is not None and not stream:
        raise bad_request("stream_options", "stream_options: only with stream true")
    sampling: dict = {}
    max_tokens = _int(body, "max_completion_tokens", 1, limits.max_tokens) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limits.max_tokens)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _float(body, name)
        if value is not None:
            sampling[name] = value
    for name, low in (("top_k", -1), ("seed", None), ("min_tokens", 0), ("priority", None)):
        value = _int(body, name, low)
        if value is not None:
            sampling[name] = value
    for name in ("ignore_eos", "skip_special_tokens"):
        value = _bool(body, name)
        if value is not None:
            sampling[name] = value
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("stop_token_ids", "stop_token_ids: expected a list of integers")
        sampling["stop_token_ids"] = ids
    stop = _stop(body)
    if stop:
        sampling["stop"] = stop
    structured = _structured(body)
    if structured is not None:
        sampling["structured_outputs"] = structured
    bias = _logit_bias(body)
    if bias:
        sampling["logit_bias"] = bias
    if n > 1:
        sampling["n"] = n
    transfer = body.get("kv_transfer_params")
    if transfer is not None:  # disaggregated serving (vLLM's field; the `llm` model checks its keys)
        if not isinstance(transfer, dict):
            raise bad_request("kv_transfer_params", "kv_transfer_params: expected an object")
        sampling["kv_transfer_params"] = transfer
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad_request("user", f"user: expected a string of at most {MAX_USER_CHARS} characters")
    return GenerationRequest(chat, model, stream, include_usage, n, sampling=sampling, stream_options=options,
                             user=user or "")


def _token_ids(value) -> bool:
    """A non-empty list of token ids (whether each is the model's is the `llm` model's check)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value)


def _logit_bias(body: dict) -> dict[str, float] | None:
    """OpenAI's logit_bias: token id (as a string, JSON's keys) -> a bias in [-100, 100]. Whether
    each id is in the model's vocabulary is the `llm` model's check."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request("logit_bias", f"logit_bias: expected an object of at most {MAX_LOGIT_BIAS_ENTRIES} "
                                        "token ids (strings) -> biases")
    for token, value in bias.items():
        if not (isinstance(token, str) and token.isdigit() and int(token) <= MAX_TOKEN_ID):
            raise bad_request("logit_bias", f"logit_bias: {token!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise bad_request("logit_bias", f"logit_bias[{token}]: a bias must be a number in [-100, 100]")
    return {token: float(value) for token, value in bias.items()}


def chat_messages(body: dict) -> list:
    """A chat's messages, shape-checked (the `llm` model checks each further); always rendered with
    the generation prompt."""
    if body.get("add_generation_prompt") is False:
        raise bad_request("add_generation_prompt", "add_generation_prompt: only true is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages: required, a non-empty list of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("messages", f"messages[{index}]: expected an object with a role")
    return messages


def parse_tokenize_chat(body: dict) -> list:
    """/tokenize's messages, which get the ids `llm` computes for the chat (vLLM's defaults: the
    generation prompt added, no special tokens besides the template's)."""
    if body.get("prompt") is not None:
        raise bad_request("prompt", "prompt: send prompt or messages, not both")
    if body.get("add_special_tokens", False) is not False:
        raise bad_request("add_special_tokens", "add_special_tokens: only false with messages (the chat template "
                                                "writes the special tokens)")
    for name in TOKENIZE_CHAT_UNSUPPORTED:
        if body.get(name) not in (None, False, {}, []):
            raise bad_request(name, f"{name}: not supported by /tokenize here")
    return chat_messages(body)


def parse_chat(body, limits: Limits, served_models: tuple[str, ...]) -> GenerationRequest:
    request = _common(body, True, limits, served_models)
    request.messages = chat_messages(body)
    if _bool(body, "logprobs"):
        request.logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs", "top_logprobs: only with logprobs true")
    if request.logprobs is not None:
        request.sampling["logprobs"] = request.logprobs
    request.include_reasoning = _bool(body, "include_reasoning") is not False
    return request


def parse_completion(body, limits: Limits, served_models: tuple[str, ...]) -> GenerationRequest:
    request = _common(body, False, limits, served_models)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        request.prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        request.prompts = list(prompt)
    elif _token_ids(prompt):
        request.prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(_token_ids(p) for p in prompt):
        request.prompts = [list(p) for p in prompt]
    else:
        raise bad_request("prompt", "prompt: required, a string, a list of strings, a list of token ids or a list "
                                    "of such lists (none empty)")
    if len(request.prompts) > MAX_PROMPTS:
        raise bad_request("prompt", f"prompt: at most {MAX_PROMPTS} prompts, got {len(request.prompts)}")
    if len(request.prompts) * request.n > MAX_PROMPTS:
        raise bad_request("n", f"n: prompts x n is at most {MAX_PROMPTS}")
    if len(request.prompts) > 1 and "kv_transfer_params" in request.sampling:
        raise bad_request("kv_transfer_params", "kv_transfer_params: one prompt per disaggregated request")
    request.echo = bool(_bool(body, "echo"))
    request.logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if request.logprobs is not None:
        request.sampling["logprobs"] = request.logprobs
    return request
