"""The `llm_iterative` model's engine: one ``iterate`` call per Triton iteration, in process or not.

Triton's sequence batcher decides when an iteration runs, so this engine steps on demand: each
``iterate(adds, aborts, step)`` sends one ``CoreInput`` to a core started with ``autostep=False``
and waits for the one ``CoreOutputs`` that answers it. ``InProcessCore`` is the same call on an
``EngineCore`` of this process (``engine_process: false``).

A core that dies or stays silent past ``heartbeat_timeout`` during a call raises ``CoreLost``: the
caller ends its sequences with the reason; the next call starts a new core (counted by
``on_restart``) and goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.outputs import EngineStats, RequestOutput
from backend.engine_core.client import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS, START_TIMEOUT_SECONDS
from backend.engine_core.core import EngineCore
from backend.engine_core.messages import AddRequest, CoreInput, CoreOutputs, CoreReady
from backend.engine_core.process_handle import CoreProcess, lost_request_message, report_restart
from backend.engine_core.stub_watch import StubWatch

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05


class CoreLost(RuntimeError):
    """The engine core died or hung during a call; its requests are gone."""


class InProcessCore:
    def __init__(self, engine: LLMEngine):
        self.core = EngineCore(engine)

    def iterate(self, adds: list[AddRequest], aborts: list[str], step: bool) -> tuple[list[RequestOutput], EngineStats]:
        return self.core.iterate(adds, aborts, step), self.core.stats()

    def begin_drain(self, grace_seconds: float) -> None:
        self.core.begin_drain(grace_seconds)

    def shutdown(self, message: str) -> None:
        self.core.fail_everything(message)
        self.core.engine.close()  # the offload tier writes what it has queued


class SyncEngineCoreClient:
    def __init__(self, config: EngineConfig, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
                 on_restart: Callable[[str], None] | None = None, stub_watch: StubWatch | None = None):
        self.heartbeat_timeout = heartbeat_timeout
        self.on_restart = on_restart
        self.restarts = 0
        self._process = CoreProcess(config, autostep=False, stub_watch=stub_watch)
        self._lost = False
        self._drain_deadline: float | None = None  # monotonic; its remainder goes with every call once set

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> CoreReady:
        return self._process.start(timeout)

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    def begin_drain(self, grace_seconds: float) -> None:
        """Requests still running ``grace_seconds`` from now end with an error naming the shutdown
        (the core's deadline, EngineCore.begin_drain); it goes with the next call."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + grace_seconds

    def iterate(self, adds: list[AddRequest], aborts: list[str], step: bool) -> tuple[list[RequestOutput], EngineStats]:
        """Sends the batch and waits for its answer; raises CoreLost (see the module docstring)."""
        if self._lost:
            self._process.kill()
            ready = self._process.start(START_TIMEOUT_SECONDS)  # a CoreStartError goes to the caller
            logger.warning("engine core restarted (pid %d)", ready.pid)
            self._lost = False
        drain = None if self._drain_deadline is None else max(0.0, self._drain_deadline - time.monotonic())
        if not self._process.send(CoreInput(adds=adds, aborts=aborts, step=step or not (adds or aborts),
                                            drain_grace=drain)):
            self._lose("the engine core could not be reached")
        deadline = time.monotonic() + self.heartbeat_timeout
        while True:
            message = self._process.receive(POLL_SECONDS)
            if isinstance(message, CoreOutputs):
                if message.answers:
                    return message.outputs, message.stats
                continue  # a heartbeat from before this call
            if self._process.exit_code() is not None:
                self._lose(f"the engine core process died ({self._process.describe_exit()})")
            if time.monotonic() > deadline:
                self._process.kill()
                self._lose(f"the engine core did not answer for {self.heartbeat_timeout:g} s "
                           "(parameter engine_heartbeat_timeout_seconds) and was killed")

    def shutdown(self, message: str) -> None:
        """Ends the core's requests with ``message`` and stops it (SIGTERM, then SIGKILL)."""
        if not self._lost and self._process.send(CoreInput(shutdown=message)):
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and self._process.exit_code() is None:
                reply = self._process.receive(POLL_SECONDS)
                if isinstance(reply, CoreOutputs) and reply.final:
                    break
        self._process.terminate(timeout=5.0)

    def _lose(self, reason: str) -> None:
        logger.error("%s: its requests are lost; a new core starts with the next iteration", reason)
        self._lost = True
        self.restarts += 1
        report_restart(self.on_restart, reason)
        raise CoreLost(lost_request_message(reason))
