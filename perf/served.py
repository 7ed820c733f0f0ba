"""What the served benchmarks share: the server to benchmark (an existing one with --url, or
tritonserver started on free ports, on the repository as is or on a copy with some config.pbtxt
parameters changed, and always stopped), the tool runners' load options, the report folder, and
running a tool (perf_analyzer, genai-perf) with its console echoed and logged. Requests go through
client.bench's load generator (client.bench.runner.run_workload).

Every served benchmark takes the same server options, so a run against `make serve` and a
self-contained run differ only in ``--url``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.paths import REPO_ROOT
from backend.server.launcher import TritonServer, start_server
from perf.compare.repository import repository_with_overrides

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
RESULTS_DIR = REPO_ROOT / "perf" / "results"


@dataclass(frozen=True, slots=True)
class Served:
    grpc_url: str
    server: TritonServer | None  # None: someone else's server


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="gRPC address of a running server (default: start one on free ports, stop it after)")
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY),
                        help="what a started server serves (default: %(default)s)")


def tool_parser(prog: str, doc: str, input_help: str, results_name: str) -> argparse.ArgumentParser:
    """A tool runner's parser (``doc``: its module docstring): the server options and --model,
    --input-len, --output-len, --num-prompts, --tokenizer, --seed, --timeout, --out-dir."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0], epilog=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--model", default="llm")
    parser.add_argument("--input-len", type=int, default=128, help=f"{input_help} (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens, forced (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=100, help="distinct prompts (default: %(default)s)")
    parser.add_argument("--tokenizer", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one tool run may take")
    parser.add_argument("--out-dir", default=None, help=f"report folder (default: perf/results/{results_name}/<UTC time>)")
    return parser


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
def tritonserver(model_repository: str | Path, overrides: dict[str, str] | None = None, model: str = "llm",
                 ready_timeout: float = 300.0, edit: Callable[[str], str] | None = None,
                 env: dict[str, str] | None = None, extra_args: list[str] | None = None) -> Iterator[TritonServer]:
    """tritonserver on ``model_repository``, or, with ``overrides`` (or ``edit``), on a copy holding
    only ``model`` with those config.pbtxt parameters changed (perf.compare.repository); stopped
    (with its stubs) on exit. ``env`` and ``extra_args``: its environment and more command-line
    arguments (``start_server``'s)."""
    with tempfile.TemporaryDirectory(prefix="perf-repository-") as work:
        repository = model_repository
        if overrides or edit:
            repository = repository_with_overrides(Path(model_repository), model, overrides or {}, Path(work),
                                                   edit=edit)
        server = start_server(repository, ready_timeout=ready_timeout, env=env, extra_args=extra_args)
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def served(args: argparse.Namespace, overrides: dict[str, str] | None = None) -> Iterator[Served]:
    """Yields the server to use: ``args.url``'s (``overrides`` then do not apply: it serves what it
    serves), or one started here on ``args.model_repository`` (see ``tritonserver``)."""
    if args.url:
        yield Served(args.url, None)
        return
    print(f"starting tritonserver on {args.model_repository} {overrides or ''}...", flush=True)
    with tritonserver(args.model_repository, overrides) as server:
        print(f"tritonserver ready: gRPC {server.grpc_url}, HTTP {server.http_url}", flush=True)
        yield Served(server.grpc_url, server)
