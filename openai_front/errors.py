"""OpenAI's error object, and how Triton's errors map onto HTTP statuses.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the field that caused it
in ``param``. Triton's gRPC stream carries an error's text only (no status code), so the status
comes from what the `llm` model says: one client over its cap is 429, busy and unloading are 503
(both with Retry-After), our own failures 500, and anything else, which names the request's bad
field, 400.
"""

from __future__ import annotations

from dataclasses import dataclass

# The `llm` model's input names, as the fields of an OpenAI request.
TRITON_TO_OPENAI_FIELDS = {"text_input": "prompt", "input_ids": "prompt", "messages": "messages", "sampling_parameters": None,
                           "max_tokens": "max_tokens", "stop_words": "stop"}
UNAVAILABLE_MARKERS = ("server busy", "the model is being unloaded", "not ready", "unavailable",
                       "is shutting down", "draining")
CLIENT_BUSY_MARKER = "server busy for "  # backend/engine_core/client_cap.py: one client at its cap
INTERNAL_MARKERS = ("internal error",)
RETRY_AFTER_SECONDS = 1


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status in (429, 503) else {}


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_request_error", code)


def from_triton(message: str) -> ApiError:
    """An error Triton sent for a request, as the API error a client of OpenAI expects."""
    lowered = message.lower()
    if CLIENT_BUSY_MARKER in lowered:
        return ApiError(429, message, None, "rate_limit_exceeded", "rate_limit_exceeded")
    if any(marker in lowered for marker in UNAVAILABLE_MARKERS):
        return ApiError(503, message, None, "service_unavailable", "service_unavailable")
    if any(lowered.startswith(marker) for marker in INTERNAL_MARKERS):
        return ApiError(500, message, None, "internal_error", "internal_error")
    return bad_request(_param_of(message), message)


def _param_of(message: str) -> str | None:
    """The field an `llm` error message starts with (``max_tokens: ...``), in OpenAI's names."""
    head = message.split(":", 1)[0].strip()
    if not head or " " in head:
        return None
    root = head.split(".", 1)[0].split("[", 1)[0]
    if root == "sampling_parameters" and "." in head:
        return head.split(".", 1)[1]
    return TRITON_TO_OPENAI_FIELDS.get(root, head)
