"""The OpenAI batch file format, both ways: an input line to the `llm` model's inputs, a result to an
output line.

Input lines (https://platform.openai.com/docs/guides/batch): ``{"custom_id", "method": "POST",
"url": "/v1/chat/completions" | "/v1/completions", "body": {...}}``; the body carries ``messages``
(chat) or ``prompt`` (a string) and the sampling fields of those endpoints (``max_tokens`` or
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, the penalties, ``n`` = 1,
``response_format`` of type ``text``, ``json_object`` or ``json_schema``) plus vLLM's extra keys
(``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``structured_outputs``,
``guided_*``). ``model`` and ``stream`` are accepted and ignored (the runner picks the model and
always streams). Anything else is an error naming the key, for that line alone.

Output lines: ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error":
null}`` with a ``chat.completion`` or ``text_completion`` body; a failed line has ``"response": null``
(or the response, when only a post-processing check failed) and ``"error": {"code", "message"}``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
IGNORED_BODY_KEYS = frozenset({"model", "stream", "stream_options", "user"})
# Body keys passed to the model's sampling_parameters under the same name.
SAMPLING_KEYS = frozenset({"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                           "min_tokens", "repetition_penalty", "ignore_eos", "structured_outputs", "guided_json",
                           "guided_regex", "guided_choice", "guided_grammar", "skip_special_tokens", "priority"})


class LineError(ValueError):
    """A line the runner cannot send; ``code`` is the error kind of the summary."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class BatchRequest:
    line_number: int  # 1-based, in the input file
    custom_id: str
    url: str
    options: dict  # StreamingClient.generate keyword arguments (messages or prompt, sampling_parameters...)
    prompt: str | None = None
    schema: dict | None = None  # the JSON schema the output must follow (response_format / structured outputs)
    wants_json: bool = False  # the request asked for JSON (a schema or json_object)
    body_model: str | None = None
    extra: dict = field(default_factory=dict)


def parse_line(line_number: int, text: str) -> BatchRequest:
    """One input line; raises LineError naming what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError("invalid_line", f"line {line_number}: not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_line", f"line {line_number}: expected a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("invalid_line", f"line {line_number}: custom_id: expected a non-empty string")
    url = obj.get("url", CHAT_URL if isinstance(obj.get("body"), dict) and "messages" in obj["body"] else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise LineError("invalid_request", f"url: {url!r} is not served here (use {CHAT_URL} or {COMPLETIONS_URL})")
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_request", f"method: expected POST, got {obj.get('method')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body: expected a JSON object")
    request = BatchRequest(line_number, custom_id, url, {}, body_model=body.get("model"))
    _map_body(request, body)
    return request


def _map_body(request: BatchRequest, body: dict) -> None:
    options, sampling = request.options, {}
    if request.url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise LineError("invalid_request", "body.messages: expected a non-empty list of messages")
        options["messages"] = messages
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise LineError("invalid_request", "body.prompt: expected a string (one prompt per line)")
        request.prompt = prompt
    for key, value in body.items():
        where = f"body.{key}"
        if key in ("messages", "prompt") or key in IGNORED_BODY_KEYS or value is None:
            continue
        if key in ("max_tokens", "max_completion_tokens"):
            sampling["max_tokens"] = value
        elif key == "stop":
            sampling["stop"] = [value] if isinstance(value, str) else value
        elif key == "n":
            if value != 1:
                raise LineError("invalid_request", f"{where}: only 1 is supported, got {value!r}")
        elif key == "response_format":
            _response_format(request, sampling, value, where)
        elif key in SAMPLING_KEYS:
            sampling[key] = value
        else:
            raise LineError("invalid_request", f"{where}: not supported by this runner")
    constraint = sampling.get("structured_outputs") or {}
    for schema in (constraint.get("json") if isinstance(constraint, dict) else None, sampling.get("guided_json")):
        if schema is not None:
            request.wants_json = True
            request.schema = json.loads(schema) if isinstance(schema, str) else schema
    if isinstance(constraint, dict) and constraint.get("json_object"):
        request.wants_json = True
    options["sampling_parameters"] = sampling
    options["stream"] = True


def _response_format(request: BatchRequest, sampling: dict, value, where: str) -> None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise LineError("invalid_request", f"{where}: expected {{\"type\": \"text\" | \"json_object\" | \"json_schema\"}}")
    if value["type"] == "json_object":
        sampling["structured_outputs"] = {"json_object": True}
    elif value["type"] == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise LineError("invalid_request", f"{where}.json_schema.schema: expected a JSON schema object")
        sampling["structured_outputs"] = {"json": schema}


# ----------------------------------------------------------------------------------------- output
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def success_line(request: BatchRequest, result, model: str, request_id: str) -> dict:
    """The output line of a request the server answered (``result`` is a client.stream.StreamResult)."""
    finish = FINISH_REASONS.get(result.finish_reason, result.finish_reason or "stop")
    prompt_tokens = result.num_input_tokens or 0
    completion_tokens = result.num_output_tokens if result.num_output_tokens is not None else len(result.token_ids)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    created = int(time.time())
    if request.url == CHAT_URL:
        body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "finish_reason": finish, "logprobs": None}], "usage": usage}
    else:
        body = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None}],
                "usage": usage}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_line(custom_id: str | None, code: str, message: str, line_number: int | None = None,
               response: dict | None = None) -> dict:
    """A failed line; ``line_number`` is kept for lines the runner keys by position (no usable custom_id)."""
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": {"code": code, "message": message}}
    if line_number is not None:
        line["line"] = line_number
    return line


def output_text(line: dict) -> str | None:
    """The generated text of an output line (None when it has no response)."""
    response = line.get("response") or {}
    choices = (response.get("body") or {}).get("choices") or [{}]
    choice = choices[0]
    return choice["message"]["content"] if "message" in choice else choice.get("text")
