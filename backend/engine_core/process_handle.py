"""Starting, reaching and stopping one engine-core process (backend/engine_core/core_process.py).

The front end binds two ipc:// sockets in a private folder (PUSH for inputs, PULL for outputs),
writes the engine config there, and starts ``python -m backend.engine_core.core_process`` with its
own interpreter (a fresh interpreter: the spawn method, never fork, which would copy the stub's
threads and Triton's shared memory handles). The child connects and answers ``CoreReady`` once its
model is loaded, or ``CoreFailed`` naming why not. Each start gets new sockets, so nothing sent to
a dead core can reach its successor.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

import zmq

from backend.config import EngineConfig
from backend.engine_core.stub_watch import StubWatch
from backend.paths import REPO_ROOT, python_executable
from backend.process_exit import describe_exit_code
from backend.protocol.messages import (
    EXIT_REASON_FILE,
    CoreFailed,
    CoreInput,
    CoreReady,
    encoder,
    message_decoder,
)

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 60.0  # a slow step (a long prefill on a big model) is not a hang
START_TIMEOUT_SECONDS = 600.0  # loading a model


class CoreStartError(RuntimeError):
    """The engine core did not come up; the message says why (its own error when it sent one)."""


def lost_request_message(reason: str) -> str:
    """What a request in flight on a core that died or hung is told (both clients)."""
    return f"internal error: {reason}; the request was lost (the engine core is restarting)"


def report_restart(on_restart: Callable[[str], None] | None, reason: str) -> None:
    """Calls a client's restart hook (the restart counter); its failure must not stop the recovery."""
    if on_restart is None:
        return
    try:
        on_restart(reason)
    except Exception:
        logger.exception("counting the restart failed")


class CoreProcess:
    """One engine-core process and its two sockets. Not thread-safe: the owner serializes calls."""

    def __init__(self, config: EngineConfig, autostep: bool = True, stub_watch: StubWatch | None = None):
        self.config = config
        self.autostep = autostep  # False: the core steps only when a CoreInput asks (llm_iterative)
        self.stub_watch = stub_watch  # what the core does if this process dies under it (stub_watch.py)
        self.process: subprocess.Popen | None = None
        self._context = zmq.Context.instance()
        self._encode = encoder().encode
        self._decode = message_decoder().decode
        self._workdir: str | None = None
        self._input: zmq.Socket | None = None
        self._output: zmq.Socket | None = None

    # ------------------------------------------------------------------------------------------
    def start(self, timeout: float) -> CoreReady:
        """Starts a core and waits until it is ready; raises CoreStartError (and leaves nothing running)."""
        self.close()
        self._workdir = tempfile.mkdtemp(prefix="llm-core-")
        input_address = f"ipc://{self._workdir}/input"
        output_address = f"ipc://{self._workdir}/output"
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        spec = {"config": self.config, "parent_pid": os.getpid(), "autostep": self.autostep,
                "stub_watch": self.stub_watch,
                "input_address": input_address, "output_address": output_address}
        with open(os.path.join(self._workdir, "spec.pkl"), "wb") as handle:
            pickle.dump(spec, handle)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONUTF8", "1")
        try:
            executable = python_executable()
        except FileNotFoundError as exc:
            raise CoreStartError(str(exc)) from None
        self.process = subprocess.Popen(
            [executable, "-m", "backend.engine_core.core_process", self._workdir],
            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(0.2)
            if isinstance(message, CoreReady):
                logger.info("engine core %d ready (%d KV blocks)", message.pid, message.num_kv_blocks)
                return message
            if isinstance(message, CoreFailed):
                self.kill()
                raise CoreStartError(f"the engine core could not start: {message.message}")
            code = self.process.poll()
            if code is not None:
                self.close()
                raise CoreStartError(f"the engine core exited with code {code} before it was ready "
                                     "(its log lines start with 'engine-core')")
            if time.monotonic() > deadline:
                self.kill()
                raise CoreStartError(f"the engine core was not ready after {timeout:g} s")

    def send(self, message: CoreInput) -> bool:
        """Sends without waiting; False when the core cannot be reached (it is gone)."""
        if self._input is None:
            return False
        try:
            self._input.send(self._encode(message), zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:
            return False

    def receive(self, timeout: float):
        """The next message from the core, or None after ``timeout`` seconds."""
        if self._output is None or not self._output.poll(timeout * 1000):
            return None
        return self._decode(self._output.recv(copy=False).buffer)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        """None while the process runs (or was never started)."""
        return None if self.process is None else self.process.poll()

    def describe_exit(self) -> str:
        code = self.exit_code()
        if code is None:
            return "it stopped answering"
        reason = self._exit_reason()
        if reason:  # the core ended itself and said why (a tensor-parallel rank died)
            return f"{reason}; the core exited with code {code}"
        return f"it {describe_exit_code(code)}"

    def _exit_reason(self) -> str:
        if self._workdir is None:
            return ""
        try:
            with open(os.path.join(self._workdir, EXIT_REASON_FILE), encoding="utf-8") as handle:
                return handle.read(1000).strip()
        except OSError:
            return ""

    # ------------------------------------------------------------------------------------------
    def terminate(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; then the sockets and the folder go."""
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("engine core %d ignored SIGTERM for %g s: killing it", process.pid, timeout)
        self.kill()

    def kill(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        self.close()

    def close(self) -> None:
        """Closes the sockets and removes the folder (the process must be gone or going)."""
        for sock in (self._input, self._output):
            if sock is not None:
                sock.close(linger=0)
        self._input = self._output = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
