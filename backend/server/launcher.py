"""Starts and stops a real tritonserver on our model repository.

On a GPU machine with NVIDIA's image, ``tritonserver`` is on PATH and its backends are in place.
Elsewhere the binary comes from the ``nvidia-pytriton`` wheel, which needs (measured on Triton
2.51): a backend folder holding ``python/`` plus the Python stub built for the running interpreter;
the virtual environment's ``bin`` first on PATH (the stub's embedded Python is isolated and finds
its site-packages through the ``python3`` on PATH, otherwise responses arrive empty); and
LD_LIBRARY_PATH with libpython's folder and the wheel's bundled libraries.

Models are loaded with ``--model-control-mode=explicit --load-model=*`` unless the extra arguments
name a mode: the same models at start as the default mode, and a model whose stub died can be
unloaded and loaded again (``on_stub_death: reload``, backend/engine_core/stub_watch.py).

Stopping sends SIGTERM, then kills the whole process group after a timeout: a server with live
decoupled streams was seen not to exit, and its stub processes must not outlive it.

Command line (``make serve``): ``python -m backend.server.launcher [--model-repository DIR] [--restart
always|never] [-- extra tritonserver args]``; HTTP_PORT, GRPC_PORT, METRICS_PORT and
MODEL_REPOSITORY are honoured. It restarts a server that exits on its own (see ``main``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backend.paths import REPO_ROOT
from backend.server.openai_process import OpenAIFront
from backend.server.process_group import stop_process_group

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"


# SIGTERM lets the `llm` model drain (its shutdown_grace_seconds, 20 s by default, within
# tritonserver's own 30 s exit timeout); the process group is killed only after this.
STOP_TIMEOUT_SECONDS = 40.0


class LauncherError(RuntimeError):
    """tritonserver could not be found, laid out or brought to readiness."""


@dataclass(frozen=True, slots=True)
class TritonInstallation:
    """Where the tritonserver binary is, and the backend folder to pass it (None: its default)."""

    binary: Path
    wheel_root: Path | None  # the nvidia-pytriton wheel's tritonserver folder, when used


def find_tritonserver() -> TritonInstallation:
    """tritonserver on PATH (NGC image) wins; else the one inside the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstallation(Path(on_path), None)
    try:
        import pytriton  # noqa: PLC0415 (optional: nvidia-pytriton, only where no NGC image gives tritonserver)
    except ImportError:
        raise LauncherError(
            "tritonserver not found: not on PATH and the nvidia-pytriton wheel is not installed "
            "(run `make setup`)"
        ) from None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.exists():
        raise LauncherError(f"nvidia-pytriton is installed but {binary} is missing")
    return TritonInstallation(binary, root)


def python_stub_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backend_directory(installation: TritonInstallation, dest: Path) -> Path | None:
    """Lays out ``dest/python`` with the wheel's Python backend and the stub for this interpreter.

    Returns the folder to pass as --backend-directory, or None to keep tritonserver's default.
    """
    if installation.wheel_root is None:
        return None
    stub = installation.wheel_root / "python_backend_stubs" / python_stub_tag() / "triton_python_backend_stub"
    if not stub.exists():
        raise LauncherError(f"no Python backend stub for Python {python_stub_tag()} in {stub.parent.parent}")
    python_dir = dest / "python"
    if python_dir.exists():
        shutil.rmtree(python_dir)
    shutil.copytree(installation.wheel_root / "backends" / "python", python_dir,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    return dest


def server_environment(installation: TritonInstallation, base: dict[str, str] | None = None) -> dict[str, str]:
    """PATH with this interpreter's bin first; LD_LIBRARY_PATH with libpython and wheel libraries."""
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)  # not resolved: a venv's python is a symlink
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    library_dirs = [sysconfig.get_config_var("LIBDIR") or ""]
    if installation.wheel_root is not None:
        site = installation.wheel_root.parent.parent
        library_dirs.append(str(site / "nvidia_pytriton.libs"))
    if env.get("LD_LIBRARY_PATH"):
        library_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in library_dirs if d)
    return env


# Ports handed out are below Linux's ephemeral range (32768-60999), where the kernel never picks the
# local port of an outgoing connection: a port the OS offered as free (bind to 0) could be taken by
# some client's connection before the server meant for it binds it (measured: a replica's metrics
# port "already in use" ten restarts in a row).
FREE_PORT_RANGE = (20000, 32767)
_handed_out: set[int] = set()
_port_choice = random.Random()  # its own state: a test seeding `random` does not repeat ports


def free_port() -> int:
    """A TCP port free on loopback right now and not handed out before by this process (tests and
    the replicas command start servers on these)."""
    for _ in range(1000):
        port = _port_choice.randint(*FREE_PORT_RANGE)
        if port in _handed_out:
            continue
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {FREE_PORT_RANGE[0]}-{FREE_PORT_RANGE[1]}")


def bind_host() -> str:
    """The address servers listen on: loopback, or every interface where TRITON_BIND_ALL is set."""
    return "127.0.0.1" if os.environ.get("TRITON_BIND_ALL") is None else "0.0.0.0"


def answers_200(url: str) -> bool:
    """A GET of ``url`` answers 200 within 2 s (False when refused, unreachable or otherwise)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class TritonServer:
    """A running tritonserver process group; use as a context manager or call stop()."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path | None
    work_dir: Path
    _owns_work_dir: bool = True
    metrics_enabled: bool = True
    _stopped: bool = field(default=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        return answers_200(f"http://{self.http_url}/v2/health/ready")

    def metrics_answer(self) -> bool:
        return answers_200(self.metrics_url)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Blocks until /v2/health/ready answers 200 and, with metrics on, the metrics endpoint does
        too (Triton starts it after the HTTP service: a metrics read right after ready was refused);
        raises with the log's tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LauncherError(f"tritonserver exited with {self.process.returncode}\n{self.log_tail()}")
            if self.is_ready() and (not self.metrics_enabled or self.metrics_answer()):
                return
            time.sleep(0.25)
        raise LauncherError(f"tritonserver not ready after {timeout:.0f} s\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        """SIGTERM, then SIGKILL to the whole process group after ``timeout`` seconds."""
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        stop_process_group(self.process, timeout)
        if self._owns_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_server(
    model_repository: str | os.PathLike = DEFAULT_MODEL_REPOSITORY,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    extra_args: list[str] | None = None,
    log_path: str | os.PathLike | None = None,
    wait: bool = True,
    ready_timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> TritonServer:
    """Starts tritonserver in its own process group (ports default to free ones).

    ``log_path`` None sends the server's output to a file in a temporary folder (kept in
    ``TritonServer.log_path``); pass "-" to inherit this process's stdout/stderr.
    """
    installation = find_tritonserver()
    work_dir = Path(tempfile.mkdtemp(prefix="tritonserver-"))
    backend_dir = prepare_backend_directory(installation, work_dir / "backends")
    http_port = http_port or free_port()
    grpc_port = grpc_port or free_port()
    metrics_port = metrics_port or free_port()
    command = [
        str(installation.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--http-address={bind_host()}",
        f"--grpc-address={bind_host()}",
        "--allow-metrics=true",
    ]
    if backend_dir is not None:
        command.append(f"--backend-directory={backend_dir}")
        cache_dir = installation.wheel_root / "caches"
        if cache_dir.exists():
            command.append(f"--cache-directory={cache_dir}")
    extra = list(extra_args or [])
    if not any(arg.startswith("--model-control-mode") for arg in extra):
        # Explicit control with every model loaded at start serves as the default mode does, and lets
        # a model whose stub died be unloaded and loaded again (on_stub_death reload).
        command += ["--model-control-mode=explicit", "--load-model=*"]
    command += extra
    if log_path == "-":
        stdout, resolved_log = None, None
    else:
        resolved_log = Path(log_path) if log_path else work_dir / "tritonserver.log"
        stdout = open(resolved_log, "ab")  # noqa: SIM115 (kept open by the child)
    try:
        process = subprocess.Popen(
            command,
            env=server_environment(installation, env),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        if stdout is not None:
            stdout.close()
    metrics_flags = [arg for arg in command if arg.startswith("--allow-metrics")]
    server = TritonServer(process, http_port, grpc_port, metrics_port, resolved_log, work_dir,
                          metrics_enabled=metrics_flags[-1] != "--allow-metrics=false")
    if wait:
        try:
            server.wait_ready(ready_timeout)
        except BaseException:
            server.stop(timeout=5)
            raise
    return server


def stop_on_signals() -> Callable[[], bool]:
    """Makes SIGTERM and SIGINT only note that a stop was asked (a foreground command's loop then
    stops its processes cleanly); returns whether one came."""
    stopping = False

    def request_stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return lambda: stopping


def main(argv: list[str] | None = None) -> int:
    """Foreground server for `make serve`: Ctrl-C or SIGTERM stops it and every stub it started.

    A server that exits on its own after it was ready (a crash, or our `llm` model stopping it
    because its stub died, see backend/engine_core/stub_watch.py) is started again, as Docker's
    restart policy does in docker-compose.yml: ``--restart never`` turns that off, and
    ``--max-restarts`` bounds a crash loop. A server that never became ready is not restarted (a
    broken repository would only fail again).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, extra = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="python -m backend.server.launcher", description=main.__doc__)
    parser.add_argument("--model-repository", default=os.environ.get("MODEL_REPOSITORY", str(DEFAULT_MODEL_REPOSITORY)))
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--restart", choices=("always", "never"), default="always",
                        help="start tritonserver again when it exits on its own after it was ready (default always)")
    parser.add_argument("--max-restarts", type=int, default=10, help="give up after this many restarts (default 10)")
    parser.add_argument("--openai-port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)),
                        help="port of the OpenAI-compatible API (openai_front; default 9000, env OPENAI_PORT)")
    parser.add_argument("--no-openai", action="store_true", help="serve Triton's endpoints only")
    args = parser.parse_args(argv)
    stopping = stop_on_signals()
    front = None
    if not args.no_openai:
        front = OpenAIFront(args.grpc_port, args.openai_port, host=bind_host(), max_restarts=args.max_restarts)
        front.start()
    try:
        return _serve(args, extra, stopping, front)
    finally:
        if front is not None:
            front.stop()


def _serve(args, extra: list[str], stopping, front) -> int:
    """tritonserver, started again by the restart rules (main's docstring) until ``stopping()``."""
    restarts = 0
    while True:
        code, was_ready, ran_for = serve_once(args, extra, stopping, front)
        if stopping():
            return 0
        if args.restart == "never" or not was_ready or restarts >= args.max_restarts:
            if was_ready and args.restart == "always":
                print(f"tritonserver exited with code {code}: not restarted, {restarts} restarts already",
                      file=sys.stderr, flush=True)
            return code or 0
        restarts += 1
        print(f"tritonserver exited on its own with code {code} after {ran_for:.0f} s: restarting it "
              f"(restart {restarts} of at most {args.max_restarts})", file=sys.stderr, flush=True)
        time.sleep(RESTART_DELAY_SECONDS)


RESTART_DELAY_SECONDS = 1.0


def serve_once(args, extra: list[str], stopping, front=None) -> tuple[int | None, bool, float]:
    """Runs one tritonserver until it exits or ``stopping()``; returns (its exit code, whether it
    was ever ready, seconds it ran). Its whole process group is gone on return. ``front``: the
    OpenAI front (backend/server/openai_process.py), started again here if it exits."""
    started = time.monotonic()
    server = start_server(
        args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
        extra_args=extra, log_path="-", wait=False,
    )
    was_ready = False
    try:
        while not stopping() and server.process.poll() is None:
            if not was_ready and server.is_ready():
                print(
                    f"tritonserver ready: HTTP {server.http_url}, gRPC {server.grpc_url}, "
                    f"metrics {server.metrics_url} (Ctrl-C stops it)",
                    flush=True,
                )
                if front is not None:
                    print(f"OpenAI-compatible API: {front.url} (chat/completions, completions, models)", flush=True)
                was_ready = True
            if front is not None:
                front.check()
            time.sleep(0.5)
    finally:
        code = server.stop()
    return code, was_ready, time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())
