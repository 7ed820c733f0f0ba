"""One generation's plumbing, shared by the completion routes: the answer's tally, the slots that
bound generations in flight, the merge of a request's gRPC streams, the reader with its idle
timeout, orphan and disconnect watches, and the streamed response that always cleans up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from openai_front.errors import ApiError
from openai_front.metrics import FrontMetrics
from openai_front.orphan_watch import ORPHAN_CHECK_SECONDS, OrphanWatch
from openai_front.responses import Choice, Usage
from openai_front.triton_bridge import Piece

DISCONNECT_POLL_SECONDS = 0.1


class Tally:
    """What one answer adds up: the usage always and, for a non-streamed answer, each choice."""

    def __init__(self, n: int, keep_choices: bool):
        self.n, self.keep_choices = n, keep_choices
        self.choices: dict[int, Choice] = {}
        self.completion_tokens = 0
        self._prompt_tokens: dict[int, int] = {}  # per prompt (choice // n), not per sample
        self._cached_tokens: dict[int, int] = {}  # of those, found in a cache (per prompt)
        self.kv_transfer_params: dict | None = None  # a prefill engine's answer (disaggregated serving)

    def add(self, index: int, piece: Piece) -> None:
        self.completion_tokens += piece.num_output_tokens
        if piece.kv_transfer_params is not None:
            self.kv_transfer_params = piece.kv_transfer_params
        if piece.num_input_tokens is not None:
            self._prompt_tokens[index // self.n] = piece.num_input_tokens
        if piece.num_cached_tokens is not None:
            self._cached_tokens[index // self.n] = piece.num_cached_tokens
        if not self.keep_choices:
            return
        choice = self.choices.setdefault(index, Choice(index))
        choice.text += piece.text
        choice.logprobs.extend(piece.logprobs)
        if piece.finish_reason is not None:
            choice.finish_reason = piece.finish_reason

    def usage(self) -> Usage:
        return Usage(sum(self._prompt_tokens.values()), self.completion_tokens, sum(self._cached_tokens.values()))


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


class Slots:
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


async def merged(generations: list[AsyncIterator[Piece]], n: int) -> AsyncIterator[tuple[int, Piece]]:
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


class Generation:
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


class CleanupStreamingResponse(StreamingResponse):
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
