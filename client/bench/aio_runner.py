"""The load generator's users as coroutines on one event loop, each holding its own gRPC stream
(client.stream_aio): what ``run_workload`` does with a thread and a threaded client per user, for a
fraction of the client's CPU on the cores it shares with the server (``run_workload``'s
``api=API_TRITON_AIO`` runs here).

The same arrival patterns (client.bench.arrivals.Schedule) and records (client.bench.completed) as client.bench.runner:
closed loop (concurrency N, each user takes the next request when its previous one ends) or open
loop (a dispatcher releases requests at their offsets to up to ``max_concurrency`` users; a request
sent late because every user is busy is timed from when it was sent). Times are taken on the loop
as each response is read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from client.bench.arrivals import Schedule
from client.bench.completed import (
    CompletedRequest,
    completed_request,
    failed_request,
    token_counter,
    triton_inputs,
)
from client.bench.progress import Progress
from client.bench.workload import WorkItem
from client.stream_aio import AioStreamingClient


class _AioUser:
    """One simulated user: a lazily opened stream, reopened after a failure."""

    def __init__(self, url: str, model: str, timeout_s: float):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.client: AioStreamingClient | None = None

    async def run(self, item: WorkItem, progress: Progress) -> CompletedRequest:
        on_response, inputs = token_counter(progress), triton_inputs(item)
        start = time.monotonic()
        try:
            if self.client is None:
                self.client = AioStreamingClient(self.url, self.model)
            result = await self.client.generate(item.prompt, self.timeout_s, on_response=on_response, **inputs)
        except Exception as exc:  # noqa: BLE001 (connection refused, timeouts: a failed request, not a crash)
            await self.close(cancel=True)  # the stream may still hold the request: start afresh
            return failed_request(item, start, exc, progress)
        return completed_request(item, result, progress)

    async def close(self, cancel: bool = False) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                await client.close(cancel_requests=cancel)
            except Exception:  # noqa: BLE001 (a broken stream must not hide the request's own error)
                pass


def run_users_aio(url: str, model: str, items: Sequence[WorkItem], schedule: Schedule, timeout_s: float,
                  progress: Progress) -> tuple[list[CompletedRequest], float]:
    """Runs every item as ``schedule`` releases it on Triton's gRPC streams, one per user; returns
    results in item order and the wall duration (s): ``run_workload``'s run for API_TRITON_AIO."""
    return asyncio.run(_run(url, model, items, schedule, timeout_s, progress))


async def _run(url, model, items, schedule, timeout_s, progress):
    results: list[CompletedRequest | None] = [None] * len(items)
    work: asyncio.Queue = asyncio.Queue()

    async def serve_user() -> None:
        user = _AioUser(url, model, timeout_s)
        try:
            while (index := await work.get()) is not None:
                results[index] = await user.run(items[index], progress)
        finally:
            await user.close()

    start = time.monotonic()
    users = [asyncio.create_task(serve_user(), name=f"bench-user-{i}") for i in range(schedule.num_users)]
    for index, due in schedule.releases(start):
        if (delay := due - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        work.put_nowait(index)
    await asyncio.gather(*users)
    return [r for r in results if r is not None], time.monotonic() - start
