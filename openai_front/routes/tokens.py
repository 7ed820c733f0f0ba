"""vLLM's ``POST /tokenize`` (a prompt, or chat messages rendered as `llm` renders them) and
``POST /detokenize``, through Triton's `tokenizer` model."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_front.errors import ApiError, bad_request
from openai_front.protocol import parse_tokenize_chat
from openai_front.state import bridge_of, front_of

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    front, bridge = front_of(request), bridge_of(request)
    try:
        body = await front.read_json(request)
        if not isinstance(body, dict):
            raise bad_request(None, "the body must be a JSON object")
        front.check_model(body)
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
        return front.error_response("tokenize", error)


@router.post("/detokenize")
async def detokenize(request: Request):
    front = front_of(request)
    try:
        body = await front.read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                   0 <= t < 2**31 for t in tokens):
            raise bad_request("tokens", "tokens: required, a list of token ids")
        front.check_model(body)
        return {"prompt": await bridge_of(request).detokenize(tokens)}
    except ApiError as error:
        return front.error_response("detokenize", error)
