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

from backend.request import SamplingParams, SamplingParamsError


class InputError(ValueError):
    """A request input is missing or bad; the message starts with the field's name."""


@dataclass(slots=True)
class ParsedRequest:
    prompt: str
    sampling_params: SamplingParams
    stream: bool
    exclude_input_in_output: bool


# Keys accepted in the `sampling_parameters` JSON object (vLLM names) -> SamplingParams field.
SAMPLING_PARAMETER_KEYS = {
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "logprobs": "logprobs",
}
# Non-sampling keys that the JSON may carry too (they override the single inputs).
REQUEST_OPTION_KEYS = ("stream", "exclude_input_in_output")

GetInput = Callable[[str], "np.ndarray | None"]

# Bounds on what one request may send, so a hostile one costs little before it is refused.
MAX_SAMPLING_PARAMETERS_BYTES = 64 * 1024
MAX_STOP_WORDS_TENSOR = 4096  # elements of the stop_words tensor (empty ones included)


def _scalar(get_input: GetInput, name: str):
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


def _as_int(name: str, value) -> int:
    if isinstance(value, bool | np.bool_):
        raise InputError(f"{name}: expected an integer, got a boolean")
    if isinstance(value, str | bytes | np.bytes_):
        raise InputError(f"{name}: expected an integer, got a string")
    if isinstance(value, float | np.floating):
        if not math.isfinite(value) or value != int(value):
            raise InputError(f"{name}: expected an integer, got {value}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected an integer, got {value!r}") from None


def _as_float(name: str, value) -> float:
    if isinstance(value, bool | np.bool_):
        raise InputError(f"{name}: expected a number, got a boolean")
    if isinstance(value, str | bytes | np.bytes_):
        raise InputError(f"{name}: expected a number, got a string")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected a number, got {value!r}") from None
    if math.isnan(result):
        raise InputError(f"{name}: must be a number, got NaN")
    return result


def _as_bool(name: str, value) -> bool:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer) and value in (0, 1):
        return bool(value)
    raise InputError(f"{name}: expected a boolean, got {value!r}")


def parse_request(
    get_input: GetInput,
    default_max_tokens: int,
    max_tokens_limit: int,
    max_prompt_bytes: int | None = None,
) -> ParsedRequest:
    """Reads the DESIGN.md tensors of one request; raises InputError naming the bad field.

    Nothing else escapes: whatever a hostile request holds, the caller gets an InputError or a
    ParsedRequest (an unexpected failure becomes an InputError naming the request).
    """
    try:
        return _parse_request(get_input, default_max_tokens, max_tokens_limit, max_prompt_bytes)
    except InputError:
        raise
    except RecursionError:
        raise InputError("sampling_parameters: nested too deeply") from None
    except Exception as exc:  # a reader bug must not fail the request's batch-mates
        raise InputError(f"request: could not be read ({type(exc).__name__}: {exc})") from None


def _parse_request(get_input: GetInput, default_max_tokens: int, max_tokens_limit: int,
                   max_prompt_bytes: int | None) -> ParsedRequest:
    raw_prompt = _scalar(get_input, "text_input")
    if raw_prompt is None:
        raise InputError("text_input: required input is missing")
    if max_prompt_bytes is not None and isinstance(raw_prompt, bytes | np.bytes_) and len(raw_prompt) > max_prompt_bytes:
        raise InputError(
            f"text_input: the prompt is {len(raw_prompt)} bytes; the limit is {max_prompt_bytes} "
            "(parameter max_prompt_bytes)"
        )
    prompt = _decode_utf8("text_input", raw_prompt)

    values: dict[str, object] = {}
    for name, field_name, convert in (
        ("max_tokens", "max_tokens", _as_int),
        ("min_length", "min_tokens", _as_int),
        ("temperature", "temperature", _as_float),
        ("top_p", "top_p", _as_float),
        ("top_k", "top_k", _as_int),
        ("random_seed", "seed", _as_int),
        ("ignore_eos", "ignore_eos", _as_bool),
    ):
        value = _scalar(get_input, name)
        if value is not None:
            values[field_name] = convert(name, value)
    stop_words = get_input("stop_words")
    if stop_words is not None:
        flat = np.asarray(stop_words).reshape(-1)
        if flat.size > MAX_STOP_WORDS_TENSOR:
            raise InputError(f"stop_words: {flat.size} elements; at most {MAX_STOP_WORDS_TENSOR}")
        words = [_decode_utf8("stop_words", w) for w in flat]
        values["stop"] = [w for w in words if w]
    options = {"stream": False, "exclude_input_in_output": True}
    for name in REQUEST_OPTION_KEYS:
        value = _scalar(get_input, name)
        if value is not None:
            options[name] = _as_bool(name, value)

    raw_json = _scalar(get_input, "sampling_parameters")
    if raw_json is not None:
        values.update(_parse_sampling_json(_decode_utf8("sampling_parameters", raw_json), options))

    values.setdefault("max_tokens", default_max_tokens)
    if values["max_tokens"] > max_tokens_limit:
        raise InputError(f"max_tokens: {values['max_tokens']} is above the limit {max_tokens_limit}")
    params = SamplingParams(**values)
    try:
        params.validate()
    except SamplingParamsError as exc:
        message = str(exc)
        if message.startswith("min_tokens"):
            message = "min_length" + message[len("min_tokens"):]
        elif message.startswith("seed"):
            message = "random_seed" + message[len("seed"):]
        raise InputError(message) from None
    return ParsedRequest(prompt, params, bool(options["stream"]), bool(options["exclude_input_in_output"]))


def _parse_sampling_json(text: str, options: dict[str, bool]) -> dict[str, object]:
    if len(text) > MAX_SAMPLING_PARAMETERS_BYTES:
        raise InputError(
            f"sampling_parameters: {len(text)} characters; at most {MAX_SAMPLING_PARAMETERS_BYTES}"
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"sampling_parameters: malformed JSON ({exc.msg} at position {exc.pos})") from None
    except RecursionError:
        raise InputError("sampling_parameters: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise InputError("sampling_parameters: expected a JSON object")
    values: dict[str, object] = {}
    for key, value in obj.items():
        where = f"sampling_parameters.{key}"
        if key in REQUEST_OPTION_KEYS:
            options[key] = _as_bool(where, value)
        elif key not in SAMPLING_PARAMETER_KEYS:
            known = ", ".join(sorted([*SAMPLING_PARAMETER_KEYS, *REQUEST_OPTION_KEYS]))
            raise InputError(f"sampling_parameters: unknown key '{key}' (known: {known})")
        elif key in ("stop",):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise InputError(f"{where}: expected a string or a list of strings")
            values["stop"] = [s for s in value if s]
        elif key == "stop_token_ids":
            if not isinstance(value, list):
                raise InputError(f"{where}: expected a list of integers")
            values["stop_token_ids"] = [_as_int(where, v) for v in value]
        elif key in ("ignore_eos", "logprobs"):
            values[key] = _as_bool(where, value)
        elif key == "seed":
            values["seed"] = None if value is None else _as_int(where, value)
        elif key == "top_k":
            top_k = _as_int(where, value)
            values["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1
        elif key in ("max_tokens", "min_tokens"):
            values[key] = _as_int(where, value)
        else:
            values[key] = _as_float(where, value)
    return values
