"""The OpenAI front's routes, one APIRouter per endpoint family."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request

# handler(request, endpoint, chat): ``endpoint`` labels the front's metrics, ``chat`` picks the chat route.
CompletionsHandler = Callable[[Request, str, bool], Awaitable]


def completions_routes(handler: CompletionsHandler, suffix: str = "") -> APIRouter:
    """A router with ``POST /v1/chat/completions<suffix>`` and ``POST /v1/completions<suffix>``, both
    answered by ``handler``; the endpoints (and the routes' names, ``chat_completions`` and
    ``completions``) are ``chat`` and ``completions`` followed by ``suffix`` with ``/`` as ``_``."""
    router = APIRouter()
    tail = suffix.replace("/", "_")
    for path, name, endpoint, chat in (("/v1/chat/completions", "chat_completions", "chat", True),
                                       ("/v1/completions", "completions", "completions", False)):
        router.add_api_route(path + suffix, _calling(handler, endpoint + tail, chat), methods=["POST"],
                             name=name + tail)
    return router


def _calling(handler: CompletionsHandler, endpoint: str, chat: bool):
    """A route answering with ``handler(request, endpoint, chat)``."""
    async def route(request: Request):
        return await handler(request, endpoint, chat)

    return route
