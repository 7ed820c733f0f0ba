"""The load generator's ways of holding gRPC streams to Triton, by name (perf's ``--triton-client``).

* ``shared-stream``: every user's requests on one stream (threads; the least client CPU of the
  threaded kinds);
* ``stream-per-user``: a thread and a threaded tritonclient stream per user, as separate client
  programs would hold them;
* ``aio-stream-per-user``: a stream per user as well, each a coroutine of tritonclient's asyncio
  client on one event loop (client.bench.aio_runner), as vLLM's benchmark clients run.
"""

from __future__ import annotations

from collections.abc import Sequence

from client.bench.aio_runner import run_workload_aio
from client.bench.arrivals import ArrivalPattern
from client.bench.runner import API_TRITON, API_TRITON_HTTP, CompletedRequest, run_workload
from client.bench.workload import WorkItem

TRITON_CLIENTS = ("shared-stream", "stream-per-user", "aio-stream-per-user", "http-stream-per-user")


def client_url(server, client: str) -> str:
    """The address of ``server`` (backend.server.launcher.TritonServer) that ``client`` talks to."""
    return server.http_url if client == "http-stream-per-user" else server.grpc_url


def run_triton_workload(url: str, model: str, items: Sequence[WorkItem], pattern: ArrivalPattern, client: str,
                        **options) -> tuple[list[CompletedRequest], float]:
    """``run_workload`` on Triton with the streams ``client`` names (``url``: ``client_url``; ``options``: seed,
    timeout_s, max_concurrency, progress)."""
    if client == "aio-stream-per-user":
        return run_workload_aio(url, model, items, pattern, **options)
    if client == "http-stream-per-user":
        return run_workload(url, model, items, pattern, api=API_TRITON_HTTP, **options)
    if client not in TRITON_CLIENTS:
        raise ValueError(f"triton client: expected one of {', '.join(TRITON_CLIENTS)}, got {client!r}")
    return run_workload(url, model, items, pattern, api=API_TRITON, shared_stream=client == "shared-stream",
                        **options)
