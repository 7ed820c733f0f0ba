"""Sends a workload to the server over gRPC streams and records each request's timing.

Threads, one ``StreamingClient`` (one gRPC stream) per user: a stream carries one pending request
at a time because stream errors carry no request id. Closed loop (concurrency N): N users each take
the next request when their previous one ends. Open loop (rate, burst): a dispatcher releases
requests at their scheduled offsets to a pool of up to ``max_concurrency`` users; a request sent
late because every user is busy is timed from when it was actually sent (as vLLM does).

Times come from ``time.monotonic()`` taken in tritonclient's callback thread as each response
arrives (client.stream), so they include gRPC and Python overheads, as a user would see them.

Every served benchmark sends its requests through ``run_workload``: forced-length items, or items
carrying their own inputs (``WorkItem.inputs``: chat messages, structured-output constraints), on
a stream per user, one stream shared by all, or (``headers``) a fresh stream per request opened
with that request's gRPC metadata, as a proxy that routes by it needs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

from client.bench.aio_runner import run_users_aio
from client.bench.arrivals import ArrivalPattern, Schedule
from client.bench.completed import (
    CompletedRequest,
    completed_request,
    failed_request,
    token_counter,
    triton_inputs,
)
from client.bench.progress import Progress
from client.bench.workload import WorkItem
from client.openai_stream import OpenAIStreamingClient
from client.stream import SharedStream, StreamingClient
from client.triton_http_stream import TritonHTTPStreamingClient

API_TRITON = "triton"  # Triton gRPC streaming (client.stream), the `llm` model's tensors
API_OPENAI = "openai"  # OpenAI-compatible /v1/completions over HTTP (client.openai_stream): vLLM and peers
API_TRITON_HTTP = "triton-http"  # Triton's HTTP generate_stream (client.triton_http_stream), the `llm` model's inputs
API_TRITON_AIO = "triton-aio"  # API_TRITON with each user a coroutine on one event loop (client.stream_aio)


class SimulatedUser:
    """One simulated user: a lazily opened stream, reopened after a failure, or its requests on the
    stream every user shares (``shared``), or a stream per request opened with ``headers(item)``."""

    def __init__(self, url: str, model: str, timeout_s: float, api: str = API_TRITON,
                 shared: SharedStream | None = None, headers: Callable[[WorkItem], dict] | None = None):
        if api not in (API_TRITON, API_OPENAI, API_TRITON_HTTP):
            raise ValueError(f"api: expected {API_TRITON!r}, {API_OPENAI!r} or {API_TRITON_HTTP!r}, got {api!r}")
        self.url, self.model, self.timeout_s, self.api, self.shared = url, model, timeout_s, api, shared
        self.headers = headers
        self.client: StreamingClient | OpenAIStreamingClient | TritonHTTPStreamingClient | None = None

    def close(self, cancel: bool = False) -> None:
        if self.client is not None:
            try:
                self.client.close(cancel_requests=cancel)
            except Exception:  # noqa: BLE001 (a broken stream must not hide the request's own error)
                pass
            self.client = None

    def run(self, item: WorkItem, progress: Progress) -> CompletedRequest:
        if self.api == API_OPENAI:
            return self._run_openai(item, progress)
        if self.api == API_TRITON_HTTP:
            return self._run_triton_http(item, progress)
        on_response, inputs = token_counter(progress), triton_inputs(item)
        start = time.monotonic()
        if self.shared is not None:
            try:
                result = self.shared.generate(item.prompt, self.timeout_s, on_response=on_response, **inputs)
            except Exception as exc:  # noqa: BLE001 (a timeout: a failed request, not a crash)
                return failed_request(item, start, exc, progress)
            return completed_request(item, result, progress)
        try:
            if self.headers is not None:
                self.close()
                self.client = StreamingClient(self.url, self.model, headers=self.headers(item))
            elif self.client is None:
                self.client = StreamingClient(self.url, self.model)
            start = time.monotonic()
            rid = self.client.send(item.prompt, **inputs)
            result = self.client.collect([rid], {rid: start}, self.timeout_s, on_response=on_response)[rid]
        except Exception as exc:  # noqa: BLE001 (connection refused, timeouts: a failed request, not a crash)
            self.close(cancel=True)  # the stream may still hold the request: start afresh
            return failed_request(item, start, exc, progress)
        if self.headers is not None:
            self.close()
        return completed_request(item, result, progress)

    def _run_triton_http(self, item: WorkItem, progress: Progress) -> CompletedRequest:
        start = time.monotonic()
        try:
            if self.client is None:
                self.client = TritonHTTPStreamingClient(self.url, self.model, self.timeout_s)
            result = self.client.generate(item.prompt, on_response=token_counter(progress), **triton_inputs(item))
        except Exception as exc:  # noqa: BLE001 (connection refused, timeouts: a failed request, not a crash)
            self.close(cancel=True)
            return failed_request(item, start, exc, progress)
        return completed_request(item, result, progress)

    def _run_openai(self, item: WorkItem, progress: Progress) -> CompletedRequest:
        if item.inputs is not None:
            raise ValueError("--api openai sends forced-length prompts only (WorkItem.inputs is Triton's)")
        start = time.monotonic()
        try:
            if self.client is None:
                self.client = OpenAIStreamingClient(self.url, self.model, self.timeout_s)
            result = self.client.generate(item.prompt, item.max_tokens, ignore_eos=True,
                                          on_chunk=lambda _result: progress.add_tokens(1),
                                          headers=self.headers(item) if self.headers is not None else None)
        except Exception as exc:  # noqa: BLE001 (connection refused, timeouts: a failed request, not a crash)
            self.close(cancel=True)
            return failed_request(item, start, exc, progress)
        return completed_request(item, result, progress)


def run_workload(
    url: str,
    model: str,
    items: Sequence[WorkItem],
    pattern: ArrivalPattern,
    seed: int = 0,
    timeout_s: float = 600.0,
    max_concurrency: int = 256,
    progress: Progress | None = None,
    api: str = API_TRITON,
    shared_stream: bool = False,
    headers: Callable[[WorkItem], dict] | None = None,
) -> tuple[list[CompletedRequest], float]:
    """Runs every item under ``pattern`` against ``api`` at ``url``; returns results in item order and
    the wall duration (s). ``shared_stream`` (Triton only): every user's requests on one gRPC stream
    (client.stream.SharedStream) instead of a stream per user: the same requests, a fraction of the
    client's CPU, which shares the machine with the server here. ``headers``: each request's
    ``headers(item)``, as the gRPC metadata of a fresh stream (Triton) or HTTP headers (OpenAI).
    ``API_TRITON_AIO``: a gRPC stream per user, the users coroutines (client.bench.aio_runner)."""
    progress = progress or Progress(pattern.label, len(items), interval_s=0)
    schedule = Schedule.plan(pattern, len(items), seed, max_concurrency)
    if api == API_TRITON_AIO:
        if shared_stream or headers is not None:
            raise ValueError(f"api {API_TRITON_AIO!r}: a stream per user, no shared stream or headers")
        return run_users_aio(url, model, items, schedule, timeout_s, progress)
    results: list[CompletedRequest | None] = [None] * len(items)
    work: queue.SimpleQueue = queue.SimpleQueue()
    shared = SharedStream(url, model) if shared_stream and api == API_TRITON and headers is None else None

    def serve_user() -> None:
        user = SimulatedUser(url, model, timeout_s, api, shared, headers)
        try:
            while True:
                index = work.get()
                if index is None:
                    return
                results[index] = user.run(items[index], progress)
        finally:
            user.close()

    start = time.monotonic()
    users = [threading.Thread(target=serve_user, name=f"bench-user-{i}", daemon=True)
             for i in range(schedule.num_users)]
    for thread in users:
        thread.start()
    for index, due in schedule.releases(start):
        if (delay := due - time.monotonic()) > 0:
            time.sleep(delay)
        work.put(index)
    for thread in users:
        while thread.is_alive():
            thread.join(timeout=0.5)  # short joins keep Ctrl-C responsive
    duration = time.monotonic() - start
    if shared is not None:
        shared.close()
    return [r for r in results if r is not None], duration
