"""What the tool runners (perf_analyzer, genai-perf) share: the server to benchmark (an existing one
with --url, or tritonserver started on free ports and always stopped), the load options, the
report folder, and running the tool with its console echoed and logged.

Every perf script takes the same server options, so a run against `make serve` and a
self-contained run differ only in ``--url``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.paths import REPO_ROOT
from backend.server.launcher import TritonServer, start_server
from client.stream import StreamingClient, StreamResult

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


def add_load_arguments(parser: argparse.ArgumentParser, input_help: str, results_name: str) -> None:
    """--model, --input-len, --output-len, --num-prompts, --tokenizer, --seed, --timeout, --out-dir."""
    parser.add_argument("--model", default="llm")
    parser.add_argument("--input-len", type=int, default=128, help=f"{input_help} (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens, forced (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=100, help="distinct prompts (default: %(default)s)")
    parser.add_argument("--tokenizer", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one tool run may take")
    parser.add_argument("--out-dir", default=None, help=f"report folder (default: perf/results/{results_name}/<UTC time>)")


def parse_tool_args(parser: argparse.ArgumentParser, argv: list[str] | None, problem: str | None,
                    results_name: str) -> tuple[argparse.Namespace, list[str], Path] | int:
    """(our arguments, the tool's extra arguments after ``--``, the report folder), or the exit
    status to return: 2 with the reason printed when the tool cannot run here (``problem``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    try:
        args = parser.parse_args(argv[:split])
    except SystemExit as exit_:  # --help, or bad arguments
        return int(exit_.code or 0)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return args, argv[split + 1:], report_dir(args, results_name)


def report_dir(args: argparse.Namespace, results_name: str) -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path(args.out_dir) if args.out_dir else RESULTS_DIR / results_name / stamp


def write_report(out: Path, name: str, document: dict, markdown: str) -> None:
    """``out/name.json`` and ``out/name.md``; prints the markdown and where it went."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(document, indent=2))
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
    print(f"results: {out}")


def generate_all(url: str, requests: list[tuple[str | None, dict]], concurrency: int,
                 timeout: float) -> list[StreamResult]:
    """Each (prompt, generate() options) from ``concurrency`` closed-loop clients, each on its own
    gRPC stream (a stream's error carries no request id); the results in request order."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for index, request in enumerate(requests):
        work.put((index, request))
    results: list[StreamResult | None] = [None] * len(requests)

    def client_loop() -> None:
        with StreamingClient(url) as client:
            while True:
                try:
                    index, (prompt, options) = work.get_nowait()
                except queue.Empty:
                    return
                results[index] = client.generate(prompt, timeout=timeout, **options)

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def run_logged(command: list[str], log_path: Path, timeout: float, env: dict[str, str],
               cwd: Path | None = None) -> int:
    """Runs a tool, echoing its console and keeping it in ``log_path``; killed after ``timeout``."""
    (log_path.parent / "command.txt").write_text(" ".join(command) + "\n")
    print("running:", " ".join(command), flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        try:
            for line in process.stdout:
                sys.stdout.write(line)
                log.write(line)
            return process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


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
