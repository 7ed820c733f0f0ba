"""What every route of the OpenAI front shares: its settings, metrics and slots, and the steps each
route takes the same way (the body read under its size bound, the model and adapter named, the
client identified, an error answered and counted)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from openai_front.auth import ApiKeys
from openai_front.errors import ApiError, bad_request
from openai_front.generation import Slots
from openai_front.metrics import FrontMetrics
from openai_front.protocol import GenerationRequest, Limits
from openai_front.triton_bridge import TritonBridge


@dataclass(frozen=True, slots=True)
class FrontSettings:
    triton_url: str = "localhost:8001"
    model: str = "llm"  # the Triton model, and the name clients use
    limits: Limits = Limits()
    max_concurrent: int = 256  # generations in flight; beyond, 503
    max_body_bytes: int = 1 << 20
    idle_timeout_s: float = 300.0  # longest silence from Triton inside one generation
    max_streams_per_client: int = 0  # one client's generations in flight; beyond, 429; 0: no cap
    api_keys: ApiKeys = ApiKeys()  # none: no key needed
    reasoning_parser: str | None = None  # openai_front/reasoning.py; None: the model's parameter, if any


@dataclass
class FrontState:
    """The app's one shared object (``app.state.front``)."""

    settings: FrontSettings
    metrics: FrontMetrics = field(default_factory=FrontMetrics)
    slots: Slots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = Slots(self.settings.max_concurrent, self.settings.max_streams_per_client, self.metrics)

    @property
    def served(self) -> tuple[str, ...]:
        return (self.settings.model,)

    def error_response(self, endpoint: str, error: ApiError) -> JSONResponse:
        self.metrics.requests.labels(endpoint, str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    async def read_json(self, request: Request):
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the body is {declared} bytes; at most {limit}", None)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the body is over {limit} bytes", None)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(None, f"the body is not valid JSON ({exc})") from None

    def check_model(self, body: dict) -> None:
        """/tokenize and /detokenize name the model optionally; when they do, it must be ours."""
        if body.get("model") not in (None, *self.served):
            raise bad_request("model", f"model: {body.get('model')!r} is not served here", "model_not_found")

    async def served_models(self, bridge: TritonBridge) -> tuple[str, ...]:
        """The model and its LoRA adapters: each adapter is a model a request names in ``model``."""
        return (*self.served, *await bridge.lora_adapters())

    def choose_adapter(self, parsed: GenerationRequest) -> None:
        """A request for an adapter's name runs the base model with that adapter (vLLM's way)."""
        if parsed.model not in self.served:
            parsed.sampling["lora_name"] = parsed.model


def client_of(request: Request, parsed: GenerationRequest) -> str:
    """The API key's name when keys are required, else the body's ``user``."""
    return getattr(request.state, "client", None) or parsed.user


def with_chat_param(error: ApiError, chat: bool) -> ApiError:
    """A chat request's prompt is its ``messages``: an error about the prompt names them."""
    if chat and error.param == "prompt":
        error.param = "messages"
    return error


def front_of(request: Request) -> FrontState:
    return request.app.state.front


def bridge_of(request: Request) -> TritonBridge:
    return request.app.state.bridge
