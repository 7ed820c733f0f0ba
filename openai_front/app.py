"""The OpenAI-compatible HTTP API: FastAPI routers (openai_front/routes/) over one TritonBridge.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
server-sent events, ``data: [DONE]`` last), ``GET /health`` (200 only while Triton's model is
ready), ``GET /metrics`` (the front's own), and vLLM's ``POST /tokenize`` / ``POST /detokenize``
and ``POST /v1/completions/render`` / ``POST /v1/chat/completions/render`` (a request's prompt
ids without generating, for vllm-router: openai_front/render.py), all through Triton's
`tokenizer` model. The front keeps no state between requests.

Bounds: the body size, ``n``, ``max_tokens`` and prompts per request (openai_front/protocol.py),
generations in flight (503 with Retry-After beyond ``max_concurrent``: nothing queues here), one
client's generations in flight (429 beyond ``max_streams_per_client``; the client is its API key's
name, else its ``user`` field: openai_front/auth.py, which also checks the optional API key), and
the silence allowed from Triton inside one generation (``idle_timeout_s``). A client that goes
away cancels its gRPC request, while it waits for the first token (polled) and while it streams
(Starlette cancels the body), so the engine frees its KV blocks.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from openai_front.auth import OPEN_PATHS
from openai_front.errors import ApiError
from openai_front.routes import completions, render, service, tokens
from openai_front.state import FrontSettings, FrontState
from openai_front.triton_bridge import TritonBridge

__all__ = ["FrontSettings", "create_app"]


def create_app(settings: FrontSettings, bridge: TritonBridge | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.bridge = bridge or TritonBridge(settings.triton_url, settings.model)
        yield
        await app.state.bridge.close()

    app = FastAPI(title="Triton LLM OpenAI-compatible API", lifespan=lifespan)
    app.state.front = FrontState(settings)
    if settings.api_keys.required:
        app.middleware("http")(_api_key_check(settings))
    for module in (completions, render, tokens, service):
        app.include_router(module.router)
    return app


def _api_key_check(settings: FrontSettings):
    """The middleware that refuses a request without a valid key (outside OPEN_PATHS) and names
    its client by the key."""
    async def require_api_key(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            identity = settings.api_keys.identify(request.headers.get("authorization"))
            if identity is None:
                error = ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", None,
                                 "invalid_request_error", "invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
            request.state.client = identity
        return await call_next(request)

    return require_api_key
