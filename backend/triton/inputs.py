"""Parses and validates one Triton request's input tensors into engine arguments.

Pure numpy: ``get_input(name)`` returns the tensor as a numpy array or None, so this is unit-tested
without a server. Every problem raises InputError naming the field; the caller turns it into an
error response for that request only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backend.protocol.kv_transfer import KVTransferParamsError, parse_kv_transfer_params
from backend.protocol.sampling import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from backend.protocol.structured_output import (
    LEGACY_KEYS,
    StructuredOutputError,
    parse_legacy_key,
    parse_structured_outputs,
)


class InputError(ValueError):
    """A request input is missing or bad; the message starts with the field's name."""


@dataclass(frozen=True, slots=True)
class ReturnOptions:
    """Triton vLLM backend's ``return_*`` inputs: which extra outputs each response carries, and in
    that backend's form (finish_reason "None" until the end, per-response token counts)."""

    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False

    @property
    def needs_logprobs(self) -> bool:
        return self.cumulative_logprob


@dataclass(slots=True)
class ParsedRequest:
    prompt: str | None  # None when the request sent messages or input_ids instead
    sampling_params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    messages: list[dict[str, str]] | None = None  # chat messages, to render with the chat template
    returns: ReturnOptions = ReturnOptions()
    stream_interval: int | None = None  # sampling_parameters.stream_interval (None: the model's default)
    lora_task_id: int | None = None  # TensorRT-LLM's lora_task_id input: an adapter by its id
    prompt_token_ids: list[int] | None = None  # the input_ids input: a prompt already tokenized


# Keys accepted in the `sampling_parameters` JSON object: vLLM's names, which are SamplingParams fields.
SAMPLING_PARAMETER_KEYS = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    "skip_special_tokens", "prompt_logprobs", "priority", "n", "beam_width", "length_penalty",
    "early_stopping", "num_speculative_tokens", "user", "logit_bias",
})
# Non-sampling keys that the JSON may carry too (they override the single inputs).
REQUEST_OPTION_KEYS = ("stream", "exclude_input_in_output")
# vLLM keys accepted with the one value we implement (clients of Triton's vLLM backend send them).
FIXED_KEYS = {"best_of": 1, "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
              "use_beam_search": False, "detokenize": True}
INT_KEYS = frozenset({"max_tokens", "min_tokens", "top_k", "seed", "priority", "n", "beam_width",
                      "num_speculative_tokens"})
BOOL_KEYS = frozenset({"ignore_eos", "skip_special_tokens"})
RETURN_INPUTS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                 "return_num_input_tokens", "return_num_output_tokens")
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_CHAT_MESSAGES = 1024
MAX_INPUT_IDS = 1 << 20  # ids in one input_ids tensor (the model's max_model_len bounds a prompt well before)

GetInput = Callable[[str], "np.ndarray | None"]

# Bounds on what one request may send, so a hostile one costs little before it is refused.
MAX_SAMPLING_PARAMETERS_BYTES = 64 * 1024
MAX_STOP_WORDS_TENSOR = 4096  # elements of the stop_words tensor (empty ones included)


def scalar(get_input: GetInput, name: str):
    """The one value of input ``name`` (None when not sent); InputError when it holds more."""
    array = get_input(name)
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InputError(f"{name}: expected one value, got {flat.size}")
    return flat[0]


def _decode_utf8(name: str, value) -> str:
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{name}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if isinstance(value, str):
        return value
    raise InputError(f"{name}: expected UTF-8 bytes, got {type(value).__name__}")


def _load_json(name: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{name}: malformed JSON ({exc.msg} at position {exc.pos})") from None
    except RecursionError:
        raise InputError(f"{name}: JSON nested too deeply") from None


def _from_text(name: str, value, convert):
    """A number sent as a JSON string (Triton's vLLM backend converts them, and its clients rely on it)."""
    try:
        return convert(value.strip())
    except ValueError:
        raise InputError(f"{name}: expected a number, got {value[:40]!r}") from None


def _number(name: str, value, kind: str, text_ok: bool):
    """``value`` as int or float; booleans and (unless ``text_ok``) strings are refused."""
    if isinstance(value, bool | np.bool_):
        raise InputError(f"{name}: expected {kind}, got a boolean")
    if text_ok and isinstance(value, str):
        value = _from_text(name, value, int if kind == "an integer" else float)
    if isinstance(value, str | bytes | np.bytes_):
        raise InputError(f"{name}: expected {kind}, got a string")
    return value


def _as_int(name: str, value, text_ok: bool = False) -> int:
    value = _number(name, value, "an integer", text_ok)
    if isinstance(value, float | np.floating) and (not math.isfinite(value) or value != int(value)):
        raise InputError(f"{name}: expected an integer, got {value}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected an integer, got {value!r}") from None


def _as_float(name: str, value, text_ok: bool = False) -> float:
    value = _number(name, value, "a number", text_ok)
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected a number, got {value!r}") from None
    if math.isnan(result):
        raise InputError(f"{name}: must be a number, got NaN")
    return result


def as_bool(name: str, value, text_ok: bool = False) -> bool:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer) and value in (0, 1):
        return bool(value)
    if text_ok and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"  # not Python's bool("false"), which is True
    raise InputError(f"{name}: expected a boolean, got {value!r}")


def parse_request(
    get_input: GetInput,
    check: Callable[[SamplingParams], None],
    max_prompt_bytes: int | None = None,
) -> ParsedRequest:
    """Reads the input tensors of one request (docs/llm-model.md, "The `llm` model's tensors"); raises InputError naming the bad field.

    The values are read here; whether they are valid is the engine's one check
    (``LLMEngine.check_sampling_params``, passed as ``check``; it also fills in the defaults, such as
    max_tokens), whose message becomes the
    InputError's as it is. Nothing else escapes: whatever a hostile request holds, the caller gets
    an InputError or a ParsedRequest (an unexpected failure becomes an InputError naming the request).
    """
    try:
        return _parse_request(get_input, check, max_prompt_bytes)
    except InputError:
        raise
    except RecursionError:
        raise InputError("sampling_parameters: nested too deeply") from None
    except Exception as exc:  # a reader bug must not fail the request's batch-mates
        raise InputError(f"request: could not be read ({type(exc).__name__}: {exc})") from None


def _parse_request(get_input: GetInput, check: Callable[[SamplingParams], None],
                   max_prompt_bytes: int | None) -> ParsedRequest:
    prompt_token_ids = _input_ids(get_input)
    prompt, messages = _prompt_or_messages(get_input, max_prompt_bytes, prompt_token_ids is not None)

    values: dict[str, object] = {}
    for name, field_name, convert in (
        ("max_tokens", "max_tokens", _as_int),
        ("min_length", "min_tokens", _as_int),
        ("temperature", "temperature", _as_float),
        ("top_p", "top_p", _as_float),
        ("top_k", "top_k", _as_int),
        ("random_seed", "seed", _as_int),
        ("seed", "seed", _as_int),  # the name Triton's OpenAI frontend sends
        ("frequency_penalty", "frequency_penalty", _as_float),
        ("presence_penalty", "presence_penalty", _as_float),
        ("ignore_eos", "ignore_eos", as_bool),
        ("priority", "priority", _as_int),
        ("num_return_sequences", "n", _as_int),  # TensorRT-LLM's name of vLLM's n
        ("beam_width", "beam_width", _as_int),  # TensorRT-LLM's beam search inputs
        ("length_penalty", "length_penalty", _as_float),
        ("early_stopping", "early_stopping", as_bool),
    ):
        value = scalar(get_input, name)
        if value is not None:
            converted = convert(name, value)
            if field_name in values and values[field_name] != converted:
                raise InputError(f"{name}: disagrees with random_seed ({values[field_name]} vs {converted})")
            values[field_name] = converted
    stop_words = get_input("stop_words")
    if stop_words is not None:
        flat = np.asarray(stop_words).reshape(-1)
        if flat.size > MAX_STOP_WORDS_TENSOR:
            raise InputError(f"stop_words: {flat.size} elements; at most {MAX_STOP_WORDS_TENSOR}")
        words = [_decode_utf8("stop_words", w) for w in flat]
        values["stop"] = [w for w in words if w]
    options: dict[str, object] = {"stream": False, "exclude_input_in_output": True}
    for name in REQUEST_OPTION_KEYS:
        value = scalar(get_input, name)
        if value is not None:
            options[name] = as_bool(name, value)
    flags = {}
    for name in RETURN_INPUTS:
        value = scalar(get_input, name)
        flags[name[len("return_"):]] = False if value is None else as_bool(name, value)
    returns = ReturnOptions(**flags)

    raw_json = scalar(get_input, "sampling_parameters")
    if raw_json is not None:
        values.update(_parse_sampling_json(_decode_utf8("sampling_parameters", raw_json), options))
    if returns.needs_logprobs:
        values["logprobs"] = True

    task_id = scalar(get_input, "lora_task_id")
    task_id = None if task_id is None else _as_int("lora_task_id", task_id)
    params = SamplingParams(**values)
    try:
        check(params)
    except ValueError as exc:  # EngineInputError or SamplingParamsError: the message names the field
        raise InputError(str(exc)) from None
    return ParsedRequest(prompt, params, bool(options["stream"]), bool(options["exclude_input_in_output"]),
                         messages, returns, options.get("stream_interval"), task_id, prompt_token_ids)


def _input_ids(get_input: GetInput) -> list[int] | None:
    """The input_ids input (INT32 [-1]): a prompt already tokenized; whether each id is in the
    vocabulary and the prompt fits the model are the model's checks."""
    raw = get_input("input_ids")
    if raw is None:
        return None
    ids = np.asarray(raw).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"input_ids: expected integer token ids, got {ids.dtype}")
    if ids.size == 0:
        raise InputError("input_ids: the prompt has no tokens")
    if ids.size > MAX_INPUT_IDS:
        raise InputError(f"input_ids: {ids.size} ids; at most {MAX_INPUT_IDS}")
    return ids.astype(np.int64).tolist()


def _prompt_or_messages(get_input: GetInput, max_prompt_bytes: int | None,
                        has_input_ids: bool = False) -> tuple[str | None, list | None]:
    """Exactly one of text_input (the prompt), messages (a chat, JSON) and input_ids (read apart)."""
    raw_prompt = scalar(get_input, "text_input")
    raw_messages = scalar(get_input, "messages")
    given = (raw_prompt is not None) + (raw_messages is not None) + has_input_ids
    if given != 1:
        raise InputError("text_input, messages: send exactly one of them (a prompt, or chat messages as JSON), "
                         "or the prompt's token ids as input_ids instead")
    if has_input_ids:
        return None, None
    name = "text_input" if raw_prompt is not None else "messages"
    raw = raw_prompt if raw_prompt is not None else raw_messages
    if max_prompt_bytes is not None and isinstance(raw, bytes | np.bytes_) and len(raw) > max_prompt_bytes:
        raise InputError(
            f"{name}: {len(raw)} bytes; the limit is {max_prompt_bytes} (parameter max_prompt_bytes)"
        )
    text = _decode_utf8(name, raw)
    if raw_prompt is not None:
        return text, None
    return None, parse_messages(text)


def parse_messages(text: str) -> list[dict[str, str]]:
    """A chat as OpenAI's messages: a non-empty JSON array of {"role", "content"} objects.

    content is a string, or a list of {"type": "text", "text": ...} parts (joined); roles are
    system, user, assistant, tool and developer. Raises InputError naming messages[i].
    """
    obj = _load_json("messages", text)
    if not isinstance(obj, list) or not obj:
        raise InputError("messages: expected a non-empty JSON array of {\"role\", \"content\"} objects")
    if len(obj) > MAX_CHAT_MESSAGES:
        raise InputError(f"messages: at most {MAX_CHAT_MESSAGES} messages, got {len(obj)}")
    messages = []
    for index, message in enumerate(obj):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InputError(f"{where}: expected an object with role and content")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise InputError(f"{where}: unknown key '{unknown[0]}' (known: content, name, role)")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InputError(f"{where}.role: expected one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise InputError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise InputError(f"{where}.content: expected a string")
        entry = {"role": role, "content": content}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise InputError(f"{where}.name: expected a string")
            entry["name"] = message["name"]
        messages.append(entry)
    return messages


def _parse_sampling_json(text: str, options: dict[str, object]) -> dict[str, object]:
    if len(text) > MAX_SAMPLING_PARAMETERS_BYTES:
        raise InputError(
            f"sampling_parameters: {len(text)} characters; at most {MAX_SAMPLING_PARAMETERS_BYTES}"
        )
    obj = _load_json("sampling_parameters", text)
    if not isinstance(obj, dict):
        raise InputError("sampling_parameters: expected a JSON object")
    values: dict[str, object] = {}
    for key, value in obj.items():
        where = f"sampling_parameters.{key}"
        if key in REQUEST_OPTION_KEYS:
            options[key] = as_bool(where, value, text_ok=True)
        elif key == "stream_interval":
            options[key] = _stream_interval(where, value)
        elif key in FIXED_KEYS:
            _check_fixed(where, key, value)
        elif key == "structured_outputs" or key in LEGACY_KEYS:
            _set_constraint(values, key, value, where)
        elif key in _READERS:
            values.update(_READERS[key](where, value))
        elif key not in SAMPLING_PARAMETER_KEYS:
            known = ", ".join(sorted({*SAMPLING_PARAMETER_KEYS, *REQUEST_OPTION_KEYS, *FIXED_KEYS, *_READERS,
                                      "stream_interval", "structured_outputs", *LEGACY_KEYS}))
            raise InputError(f"sampling_parameters: unknown key '{key}' (known: {known})")
        elif key in BOOL_KEYS:
            values[key] = as_bool(where, value, text_ok=True)
        elif key in INT_KEYS:
            values[key] = _as_int(where, value, text_ok=True)
        else:
            values[key] = _as_float(where, value, text_ok=True)
    return values


def _read_lora_name(where: str, value) -> dict[str, object]:
    """vllm_backend's key; checked against the model's adapters by the engine's check."""
    if value is not None and not isinstance(value, str):
        raise InputError(f"{where}: expected an adapter name (a string)")
    return {"lora_name": value or None}


def _read_kv_transfer_params(where: str, value) -> dict[str, object]:
    """Disaggregated serving (backend/protocol/kv_transfer.py)."""
    try:
        return {"kv_transfer_params": parse_kv_transfer_params(value, where)}
    except KVTransferParamsError as exc:
        raise InputError(str(exc)) from None


def _read_stop(where: str, value) -> dict[str, object]:
    if value is None:
        value = []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InputError(f"{where}: expected a string or a list of strings")
    return {"stop": [s for s in value if s]}


def _read_stop_token_ids(where: str, value) -> dict[str, object]:
    if not isinstance(value, list):
        raise InputError(f"{where}: expected a list of integers")
    return {"stop_token_ids": [_as_int(where, v) for v in value]}


def _read_prompt_logprobs(where: str, value) -> dict[str, object]:
    if value is None or value is False:
        return {"prompt_logprobs": None}
    return {"prompt_logprobs": 0 if value is True else _as_int(where, value, text_ok=True)}


def _read_logprobs(where: str, value) -> dict[str, object]:
    """vLLM: an int (how many top tokens besides the chosen one; 0 = only it) or null; ours before
    that: a boolean."""
    if value is None or value is False:
        return {"logprobs": False}
    if value is True:
        return {"logprobs": True}
    return {"logprobs": True, "top_logprobs": _as_int(where, value, text_ok=True)}


def _read_user(where: str, value) -> dict[str, object]:
    """The client's identity, as OpenAI's user field: the key of per-client limits."""
    if value is not None and not isinstance(value, str):
        raise InputError(f"{where}: expected a string")
    return {"user": value or ""}


def _read_early_stopping(where: str, value) -> dict[str, object]:
    """true, false or "never" (transformers' values)."""
    return {"early_stopping": "never" if value == "never" else as_bool(where, value, text_ok=True)}


def _read_optional_int(key: str):
    def read(where: str, value) -> dict[str, object]:
        return {key: None if value is None else _as_int(where, value, text_ok=True)}
    return read


def _read_top_k(where: str, value) -> dict[str, object]:
    top_k = _as_int(where, value, text_ok=True)
    return {"top_k": 0 if top_k == -1 else top_k}  # vLLM spells "off" as -1


def _read_logit_bias(where: str, value) -> dict[str, object]:
    """OpenAI's and vLLM's map of token id (a JSON object's keys are strings) to a bias; the range
    and the ids are the engine's one check."""
    if value is None:
        return {"logit_bias": {}}
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InputError(f"{where}: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
    return {"logit_bias": {_as_int(f"{where} key", token, text_ok=True): _as_float(f"{where}[{token}]", bias)
                           for token, bias in value.items()}}


# sampling_parameters keys whose values need more than a type's conversion.
_READERS = {
    "lora_name": _read_lora_name, "kv_transfer_params": _read_kv_transfer_params, "stop": _read_stop,
    "stop_token_ids": _read_stop_token_ids, "prompt_logprobs": _read_prompt_logprobs, "logprobs": _read_logprobs,
    "user": _read_user, "early_stopping": _read_early_stopping, "seed": _read_optional_int("seed"),
    "num_speculative_tokens": _read_optional_int("num_speculative_tokens"), "top_k": _read_top_k,
    "logit_bias": _read_logit_bias,
}


def _stream_interval(where: str, value) -> int | None:
    """Tokens per streamed response (backend/triton/stream_interval.py); null: the model's default."""
    if value is None:
        return None
    interval = _as_int(where, value, text_ok=True)
    if interval < 1:
        raise InputError(f"{where}: must be >= 1 (1 streams every token), got {interval}")
    return interval


def _set_constraint(values: dict[str, object], key: str, value, where: str) -> None:
    """``structured_outputs`` or a ``guided_*`` key: at most one constraint per request."""
    try:
        spec = parse_structured_outputs(value, where) if key == "structured_outputs" else parse_legacy_key(key, value, where)
    except StructuredOutputError as exc:
        raise InputError(str(exc)) from None
    if spec is None:
        return
    if "structured_outputs" in values:
        raise InputError(f"{where}: send one constraint; {values['structured_outputs'].key} is already one")
    values["structured_outputs"] = spec


def _check_fixed(where: str, key: str, value) -> None:
    """A vLLM key we accept only at the value we implement (null counts as the default)."""
    expected = FIXED_KEYS[key]
    if value is None:
        return
    if isinstance(expected, bool):
        ok = as_bool(where, value, text_ok=True) == expected
    else:
        ok = _as_int(where, value, text_ok=True) == expected
    if not ok:
        raise InputError(f"{where}: only {json.dumps(expected)} is supported, got {json.dumps(value)}")
