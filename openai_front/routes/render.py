"""vLLM's render routes for vllm-router's kv_aware policy: ``POST /v1/completions/render`` and
``POST /v1/chat/completions/render`` answer the prompt ids `llm` would compute and the sampling
parameters, without generating (the shapes: openai_front/render.py)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from openai_front.errors import ApiError
from openai_front.protocol import parse_chat, parse_completion
from openai_front.render import completion_request_ids, generate_request, without_router_fields
from openai_front.responses import new_id
from openai_front.routes import completions_routes
from openai_front.state import bridge_of, front_of, with_chat_param


async def render(request: Request, endpoint: str, chat: bool):
    """One entry per prompt (one for a chat)."""
    front, bridge = front_of(request), bridge_of(request)
    try:
        body = without_router_fields(await front.read_json(request))
        parsed = (parse_chat if chat else parse_completion)(body, front.settings.limits,
                                                            await front.served_models(bridge))
        front.choose_adapter(parsed)
        prompts = ([bridge.render_chat_ids(parsed.messages)] if chat else
                   [bridge.tokenize(prompt) if isinstance(prompt, str) else _already(prompt)
                    for prompt in parsed.prompts])
        default_max_tokens, *prompt_ids = await asyncio.gather(bridge.default_max_tokens(), *prompts)
        request_ids = [new_id(chat)] if chat else completion_request_ids(new_id(chat), len(prompt_ids))
        answers = [generate_request(request_id, ids, parsed, default_max_tokens)
                   for request_id, ids in zip(request_ids, prompt_ids, strict=True)]
    except ApiError as error:
        return front.error_response(endpoint, with_chat_param(error, chat))
    front.metrics.requests.labels(endpoint, "200").inc()
    return JSONResponse(answers[0] if chat else answers)


router = completions_routes(render, "/render")


async def _already(token_ids: list[int]) -> list[int]:
    """A token-id prompt, awaited beside the text prompts' tokenizations."""
    return token_ids
