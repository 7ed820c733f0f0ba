"""A server to benchmark: an existing one (--url), or tritonserver started on free ports and always stopped.

Every perf script takes the same two options, so a run against `make serve` and a self-contained
run differ only in ``--url``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.launcher import TritonServer, start_server

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
RESULTS_DIR = REPO_ROOT / "perf" / "results"


@dataclass(frozen=True, slots=True)
class Served:
    grpc_url: str
    http_url: str
    server: TritonServer | None  # None: someone else's server


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="gRPC address of a running server (default: start one on free ports, stop it after)")
    parser.add_argument("--http-url", default=None, help="its HTTP address (default: the gRPC host, port 8000)")
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY),
                        help="what a started server serves (default: %(default)s)")


@contextlib.contextmanager
def served(args: argparse.Namespace) -> Iterator[Served]:
    """Yields the server to use; a server started here is stopped (with its stubs) on exit."""
    if args.url:
        host = args.url.rsplit(":", 1)[0]
        yield Served(args.url, args.http_url or f"{host}:8000", None)
        return
    print(f"starting tritonserver on {args.model_repository} ...", flush=True)
    server = start_server(args.model_repository, ready_timeout=300)
    try:
        print(f"tritonserver ready: gRPC {server.grpc_url}, HTTP {server.http_url}", flush=True)
        yield Served(server.grpc_url, server.http_url, server)
    finally:
        server.stop()
