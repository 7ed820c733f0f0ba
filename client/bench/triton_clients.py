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

from client.bench.arrivals import ArrivalPattern
from client.bench.completed import CompletedRequest
from client.bench.runner import API_TRITON, API_TRITON_AIO, API_TRITON_HTTP, run_workload
from client.bench.workload import WorkItem

# --triton-client name -> (run_workload's api, shared_stream)
TRITON_CLIENTS = {
    "shared-stream": (API_TRITON, True),
    "stream-per-user": (API_TRITON, False),
    "aio-stream-per-user": (API_TRITON_AIO, False),
    "http-stream-per-user": (API_TRITON_HTTP, False),
}


def client_url(server, client: str) -> str:
    """The address of ``server`` (backend.server.launcher.TritonServer) that ``client`` talks to."""
    return server.http_url if client == "http-stream-per-user" else server.grpc_url


def run_triton_workload(url: str, model: str, items: Sequence[WorkItem], pattern: ArrivalPattern, client: str,
                        **options) -> tuple[list[CompletedRequest], float]:
    """``run_workload`` on Triton with the streams ``client`` names (``url``: ``client_url``; ``options``: seed,
    timeout_s, max_concurrency, progress)."""
    if client not in TRITON_CLIENTS:
        raise ValueError(f"triton client: expected one of {', '.join(TRITON_CLIENTS)}, got {client!r}")
    api, shared_stream = TRITON_CLIENTS[client]
    return run_workload(url, model, items, pattern, api=api, shared_stream=shared_stream, **options)
