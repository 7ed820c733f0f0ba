"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one gRPC stream per prompt, merged,
answered whole or as server-sent events (``data: [DONE]`` last)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from openai_front.errors import ApiError
from openai_front.generation import CleanupStreamingResponse, ClientGone, Generation, Tally, merged
from openai_front.orphan_watch import OrphanWatch
from openai_front.protocol import GenerationRequest, parse_chat, parse_completion
from openai_front.reasoning import PARSERS
from openai_front.render import without_router_fields
from openai_front.responses import Choice, ChunkWriter, Reasoning, full_response, new_id
from openai_front.routes import completions_routes
from openai_front.state import FrontState, bridge_of, client_of, front_of, with_chat_param
from openai_front.triton_bridge import Piece, TritonBridge


def generations(bridge: TritonBridge, parsed: GenerationRequest, request_id: str) -> list[AsyncIterator[Piece]]:
    wants_logprobs = parsed.logprobs is not None
    if parsed.chat:
        return [bridge.generate(None, parsed.messages, parsed.sampling, logprobs=wants_logprobs,
                                request_id=request_id)]
    return [bridge.generate(prompt, None, parsed.sampling, echo=parsed.echo, logprobs=wants_logprobs,
                            request_id=f"{request_id}-{i}") for i, prompt in enumerate(parsed.prompts)]


async def admit(request: Request, front: FrontState, chat: bool) -> tuple[GenerationRequest, str]:
    """The checked request and its client, holding one of the client's slots; raises ApiError."""
    body = without_router_fields(await front.read_json(request))
    parsed = (parse_chat if chat else parse_completion)(body, front.settings.limits,
                                                        await front.served_models(bridge_of(request)))
    front.choose_adapter(parsed)
    client = client_of(request, parsed)
    if client:
        parsed.sampling["user"] = client  # the `llm` model's per-client cap counts it too
    if chat:
        parsed.reasoning_parser = front.settings.reasoning_parser or await reasoning_parser_of(bridge_of(request))
    front.slots.take(client)
    return parsed, client


async def reasoning_parser_of(bridge: TritonBridge) -> str | None:
    """The model's reasoning_parser parameter; a name we do not know is the deployment's error."""
    name = await bridge.reasoning_parser()
    if name is not None and name not in PARSERS:
        raise ApiError(500, f"the model's parameter reasoning_parser: one of {', '.join(PARSERS)}, got {name!r}",
                       None, "internal_error", "internal_error")
    return name


async def generate(request: Request, endpoint: str, chat: bool):
    front, arrived = front_of(request), time.monotonic()
    try:
        parsed, client = await admit(request, front, chat)
    except ApiError as error:
        return front.error_response(endpoint, error)
    request_id = new_id(chat)
    bridge = bridge_of(request)
    pieces = merged(generations(bridge, parsed, request_id), parsed.n)
    generation = Generation(pieces, front.settings.idle_timeout_s, OrphanWatch(bridge.ready))
    released = False

    async def release() -> None:
        nonlocal released
        if not released:
            released = True
            await generation.close()
            front.slots.give(client)

    try:
        first = await generation.next(request)
    except ClientGone:
        front.metrics.disconnects.inc()
        await release()
        return Response(status_code=499)
    except ApiError as error:
        await release()
        return front.error_response(endpoint, with_chat_param(error, chat))
    front.metrics.ttft.labels(endpoint).observe(time.monotonic() - arrived)
    if parsed.stream:
        return CleanupStreamingResponse(
            stream(front, parsed, request_id, generation, first, endpoint, arrived), release,
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return await gather(front, parsed, request_id, generation, first, request, endpoint, arrived)
    except ClientGone:
        front.metrics.disconnects.inc()
        return Response(status_code=499)
    except ApiError as error:
        return front.error_response(endpoint, with_chat_param(error, chat))
    finally:
        await release()


async def gather(front, parsed, request_id, generation, first, request, endpoint, arrived) -> JSONResponse:
    """The whole answer at once."""
    tally = Tally(parsed.n, keep_choices=True)
    item = first
    while item is not None:
        tally.add(*item)
        item = await generation.next(request)
    for index in range(len(parsed.prompts or [None]) * parsed.n):
        tally.choices.setdefault(index, Choice(index))
    front.metrics.requests.labels(endpoint, "200").inc()
    front.metrics.latency.labels(endpoint).observe(time.monotonic() - arrived)
    return JSONResponse(full_response(request_id, parsed.chat, parsed.model, list(tally.choices.values()),
                                      tally.usage(), parsed.logprobs, tally.kv_transfer_params,
                                      Reasoning.of(parsed)))


async def stream(front, parsed, request_id, generation, first, endpoint, arrived):
    """The answer as server-sent events: a chunk per delta, the usage when asked, then [DONE]."""
    writer = ChunkWriter(request_id, parsed.chat, parsed.model, parsed.logprobs, Reasoning.of(parsed))
    tally = Tally(parsed.n, keep_choices=False)  # the chunks carry the text: only usage adds up
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
    front.metrics.requests.labels(endpoint, status).inc()
    front.metrics.latency.labels(endpoint).observe(time.monotonic() - arrived)


router = completions_routes(generate)
