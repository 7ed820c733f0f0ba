"""The OpenAI-compatible HTTP API: FastAPI routes over one TritonBridge.

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

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from openai_front.auth import OPEN_PATHS, ApiKeys
from openai_front.errors import ApiError, bad_request
from openai_front.metrics import FrontMetrics
from openai_front.orphan_watch import ORPHAN_CHECK_SECONDS, OrphanWatch
from openai_front.protocol import GenerationRequest, Limits, parse_chat, parse_completion, parse_tokenize_chat
from openai_front.render import completion_request_ids, generate_request, without_router_fields
from openai_front.responses import Choice, ChunkWriter, Usage, full_response, new_id
from openai_front.triton_bridge import Piece, TritonBridge

DISCONNECT_POLL_SECONDS = 0.1


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


class _Tally:
    """What one answer adds up: the usage always and, for a non-streamed answer, each choice."""

    def __init__(self, n: int, keep_choices: bool):
        self.n, self.keep_choices = n, keep_choices
        self.choices: dict[int, Choice] = {}
        self.completion_tokens = 0
        self._prompt_tokens: dict[int, int] = {}  # per prompt (choice // n), not per sample
        self.kv_transfer_params: dict | None = None  # a prefill engine's answer (disaggregated serving)

    def add(self, index: int, piece: Piece) -> None:
        self.completion_tokens += piece.num_output_tokens
        if piece.kv_transfer_params is not None:
            self.kv_transfer_params = piece.kv_transfer_params
        if piece.num_input_tokens is not None:
            self._prompt_tokens[index // self.n] = piece.num_input_tokens
        if not self.keep_choices:
            return
        choice = self.choices.setdefault(index, Choice(index))
        choice.text += piece.text
        choice.logprobs.extend(piece.logprobs)
        if piece.finish_reason is not None:
            choice.finish_reason = piece.finish_reason

    def usage(self) -> Usage:
        return Usage(sum(self._prompt_tokens.values()), self.completion_tokens)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


class _Slots:
    """Generations in flight, in all and per client, refused beyond the limits instead of queued."""

    def __init__(self, limit: int, per_client: int, metrics: FrontMetrics):
        self.limit, self.per_client, self.metrics, self.used = limit, per_client, metrics, 0
        self.by_client: dict[str, int] = {}

    def take(self, client: str) -> None:
        if self.used >= self.limit:
            self.metrics.refused.inc()
            raise ApiError(503, f"the front has {self.used} generations in flight (max_concurrent={self.limit}); "
                                f"retry later", None, "service_unavailable", "service_unavailable")
        mine = self.by_client.get(client, 0)
        if self.per_client and mine >= self.per_client:
            self.metrics.refused.inc()
            who = f"client {client!r}" if client else "requests that name no user"
            raise ApiError(429, f"{who} has {mine} generations in flight (max_streams_per_client="
                                f"{self.per_client}); retry when one has finished", None, "rate_limit_exceeded",
                           "rate_limit_exceeded")
        self.used += 1
        self.by_client[client] = mine + 1
        self.metrics.active.inc()

    def give(self, client: str) -> None:
        self.used -= 1
        left = self.by_client.pop(client) - 1
        if left:
            self.by_client[client] = left
        self.metrics.active.dec()


async def _merged(generations: list[AsyncIterator[Piece]], n: int) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) from every generation (generation g's sample s is choice g x n + s)."""
    if len(generations) == 1:
        try:
            async for piece in generations[0]:
                yield piece.index, piece
        finally:
            await generations[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(number: int, generation: AsyncIterator[Piece]) -> None:
        try:
            async for piece in generation:
                await queue.put((number * n + piece.index, piece))
            await queue.put((number, end))
        except Exception as exc:  # the consumer re-raises it
            await queue.put((number, exc))
        finally:
            await generation.aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Generation:
    """One request's merged pieces, read with the idle timeout, a watch for a model reload that
    orphaned it (openai_front/orphan_watch.py) and, optionally, a disconnect watch."""

    def __init__(self, pieces: AsyncIterator[tuple[int, Piece]], idle_timeout_s: float,
                 orphans: OrphanWatch | None = None):
        self.pieces = pieces
        self.idle_timeout_s = idle_timeout_s
        self.orphans = orphans

    async def next(self, request: Request | None = None) -> tuple[int, Piece] | None:
        """The next (index, piece); None at the end. ``request``: give up with ClientGone when it
        disconnects meanwhile (while streaming, Starlette cancels the body instead: no polling)."""
        task = asyncio.ensure_future(self.pieces.__anext__())
        waited_since = time.monotonic()
        deadline = waited_since + self.idle_timeout_s
        poll = DISCONNECT_POLL_SECONDS if request is not None else ORPHAN_CHECK_SECONDS
        try:
            while True:
                timeout = min(poll, max(0.0, deadline - time.monotonic()))
                done, _ = await asyncio.wait({task}, timeout=timeout)
                if done:
                    try:
                        piece = task.result()
                    except StopAsyncIteration:
                        return None
                    if self.orphans is not None:
                        self.orphans.heard()
                    return piece
                if request is not None and await request.is_disconnected():
                    raise ClientGone()
                if time.monotonic() >= deadline:
                    raise self._timed_out()
                if self.orphans is not None and time.monotonic() - waited_since >= ORPHAN_CHECK_SECONDS:
                    await self.orphans.check()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _timed_out(self) -> ApiError:
        return ApiError(504, f"no answer from tritonserver in {self.idle_timeout_s:.0f} s", None, "timeout", "timeout")

    async def close(self) -> None:
        await self.pieces.aclose()


class _CleanupStreamingResponse(StreamingResponse):
    """A streamed answer whose cleanup runs however the response ends (even when the client went
    away before the body started, when Starlette never iterates it)."""

    def __init__(self, body, cleanup, **kwargs):
        super().__init__(body, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def create_app(settings: FrontSettings, bridge: TritonBridge | None = None) -> FastAPI:
    metrics = FrontMetrics()
    slots = _Slots(settings.max_concurrent, settings.max_streams_per_client, metrics)
    served = (settings.model,)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.bridge = bridge or TritonBridge(settings.triton_url, settings.model)
        yield
        await app.state.bridge.close()

    app = FastAPI(title="Triton LLM OpenAI-compatible API", lifespan=lifespan)

    if settings.api_keys.required:
        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            if request.url.path not in OPEN_PATHS:
                identity = settings.api_keys.identify(request.headers.get("authorization"))
                if identity is None:
                    error = ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", None,
                                     "invalid_request_error", "invalid_api_key")
                    return JSONResponse(error.body(), status_code=401)
                request.state.client = identity
            return await call_next(request)

    def client_of(request: Request, parsed: GenerationRequest) -> str:
        """The API key's name when keys are required, else the body's ``user``."""
        return getattr(request.state, "client", None) or parsed.user

    def error_response(endpoint: str, error: ApiError) -> JSONResponse:
        metrics.requests.labels(endpoint, str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise ApiError(413, f"the body is {declared} bytes; at most {settings.max_body_bytes}", None)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise ApiError(413, f"the body is over {settings.max_body_bytes} bytes", None)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(None, f"the body is not valid JSON ({exc})") from None

    def generations(bridge: TritonBridge, parsed: GenerationRequest, request_id: str) -> list[AsyncIterator[Piece]]:
        wants_logprobs = parsed.logprobs is not None
        if parsed.chat:
            return [bridge.generate(None, parsed.messages, parsed.sampling, logprobs=wants_logprobs,
                                    request_id=request_id)]
        return [bridge.generate(prompt, None, parsed.sampling, echo=parsed.echo, logprobs=wants_logprobs,
                                request_id=f"{request_id}-{i}") for i, prompt in enumerate(parsed.prompts)]

    def check_model(body: dict) -> None:
        """/tokenize and /detokenize name the model optionally; when they do, it must be ours."""
        if body.get("model") not in (None, *served):
            raise bad_request("model", f"model: {body.get('model')!r} is not served here", "model_not_found")

    async def served_models(bridge: TritonBridge) -> tuple[str, ...]:
        """The model and its LoRA adapters: each adapter is a model a request names in ``model``."""
        return (*served, *await bridge.lora_adapters())

    def choose_adapter(parsed: GenerationRequest) -> None:
        """A request for an adapter's name runs the base model with that adapter (vLLM's way)."""
        if parsed.model not in served:
            parsed.sampling["lora_name"] = parsed.model

    def with_chat_param(error: ApiError, chat: bool) -> ApiError:
        if chat and error.param == "prompt":
            error.param = "messages"
        return error

    async def generate(request: Request, endpoint: str, chat: bool):
        arrived = time.monotonic()
        try:
            body = without_router_fields(await read_json(request))
            parsed = (parse_chat if chat else parse_completion)(body, settings.limits,
                                                                await served_models(request.app.state.bridge))
            choose_adapter(parsed)
            client = client_of(request, parsed)
            if client:
                parsed.sampling["user"] = client  # the `llm` model's per-client cap counts it too
            slots.take(client)
        except ApiError as error:
            return error_response(endpoint, error)
        request_id = new_id(chat)
        pieces = _merged(generations(request.app.state.bridge, parsed, request_id), parsed.n)
        generation = _Generation(pieces, settings.idle_timeout_s, OrphanWatch(request.app.state.bridge.ready))
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await generation.close()
                slots.give(client)

        try:
            first = await generation.next(request)
        except ClientGone:
            metrics.disconnects.inc()
            await release()
            return Response(status_code=499)
        except ApiError as error:
            await release()
            return error_response(endpoint, with_chat_param(error, chat))
        metrics.ttft.labels(endpoint).observe(time.monotonic() - arrived)
        if parsed.stream:
            return _CleanupStreamingResponse(
                _stream(parsed, request_id, generation, first, endpoint, arrived), release,
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            return await _gather(parsed, request_id, generation, first, request, endpoint, arrived)
        except ClientGone:
            metrics.disconnects.inc()
            return Response(status_code=499)
        except ApiError as error:
            return error_response(endpoint, with_chat_param(error, chat))
        finally:
            await release()

    async def _gather(parsed, request_id, generation, first, request, endpoint, arrived):
        tally = _Tally(parsed.n, keep_choices=True)
        item = first
        while item is not None:
            tally.add(*item)
            item = await generation.next(request)
        for index in range(len(parsed.prompts or [None]) * parsed.n):
            tally.choices.setdefault(index, Choice(index))
        metrics.requests.labels(endpoint, "200").inc()
        metrics.latency.labels(endpoint).observe(time.monotonic() - arrived)
        return JSONResponse(full_response(request_id, parsed.chat, parsed.model, list(tally.choices.values()),
                                          tally.usage(), parsed.logprobs, tally.kv_transfer_params))

    async def _stream(parsed, request_id, generation, first, endpoint, arrived):
        writer = ChunkWriter(request_id, parsed.chat, parsed.model, parsed.logprobs)
        tally = _Tally(parsed.n, keep_choices=False)  # the chunks carry the text: only usage adds up
        status = "200"
        try:
            item = first
            while item is not None:
                index, piece = item
                tally.add(index, piece)
                yield writer.delta(index, piece.text, piece.finish_reason, piece.logprobs)
                item = await generation.next()
            if parsed.include_usage:
                yield writer.usage(tally.usage())
        except ApiError as error:
            status = str(error.status)
            yield writer.error(with_chat_param(error, parsed.chat).body())
        yield writer.done()
        metrics.requests.labels(endpoint, status).inc()
        metrics.latency.labels(endpoint).observe(time.monotonic() - arrived)

    async def render(request: Request, endpoint: str, chat: bool):
        """The prompt ids `llm` would compute for this request, and its sampling parameters, without
        generating: one entry per prompt (openai_front/render.py)."""
        try:
            body = without_router_fields(await read_json(request))
            bridge = request.app.state.bridge
            parsed = (parse_chat if chat else parse_completion)(body, settings.limits, await served_models(bridge))
            choose_adapter(parsed)
            prompts = ([bridge.render_chat_ids(parsed.messages)] if chat else
                       [bridge.tokenize(prompt) for prompt in parsed.prompts])
            default_max_tokens, *prompt_ids = await asyncio.gather(bridge.default_max_tokens(), *prompts)
            request_ids = [new_id(chat)] if chat else completion_request_ids(new_id(chat), len(prompt_ids))
            answers = [generate_request(request_id, ids, parsed, default_max_tokens)
                       for request_id, ids in zip(request_ids, prompt_ids, strict=True)]
        except ApiError as error:
            return error_response(endpoint, with_chat_param(error, chat))
        metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(answers[0] if chat else answers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat", True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions", False)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(request: Request):
        return await render(request, "chat_render", True)

    @app.post("/v1/completions/render")
    async def completions_render(request: Request):
        return await render(request, "completions_render", False)

    @app.get("/v1/models")
    async def models(request: Request):
        bridge = request.app.state.bridge
        max_len = await bridge.max_model_len()
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "triton-llm-serving", "root": name,
                 "max_model_len": max_len} for name in served]
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "triton-llm-serving", "root": name,
                  "parent": settings.model, "max_model_len": max_len} for name in await bridge.lora_adapters()]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health(request: Request):
        ready = await request.app.state.bridge.ready()
        return Response(status_code=200 if ready else 503)

    @app.get("/metrics")
    async def front_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise bad_request(None, "the body must be a JSON object")
            check_model(body)
            bridge = request.app.state.bridge
            if body.get("messages") is not None:
                tokens = await bridge.render_chat_ids(parse_tokenize_chat(body))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise bad_request("prompt", "prompt: required, a string")
                add_special = body.get("add_special_tokens", True)
                if not isinstance(add_special, bool):
                    raise bad_request("add_special_tokens", "add_special_tokens: expected a boolean")
                tokens = await bridge.tokenize(prompt, add_special)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": await bridge.max_model_len()}
        except ApiError as error:
            return error_response("tokenize", error)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                       0 <= t < 2**31 for t in tokens):
                raise bad_request("tokens", "tokens: required, a list of token ids")
            check_model(body)
            return {"prompt": await request.app.state.bridge.detokenize(tokens)}
        except ApiError as error:
            return error_response("detokenize", error)

    return app

