"""The step-on-demand engine client (`llm_iterative`): the core steps once per ``flush()``.

Triton's sequence batcher decides when an iteration runs, so the engine steps only when one asks:
``StepOnDemandClient.flush()`` hands the queued requests and aborts to its transport in one
``iterate(adds, aborts, step)`` call and puts the answer on ``outbox`` before it returns (the
interface is backend/engine_core/engine_client.py). Two transports (``StepTransport``):

- ``ProcessTransport``: the engine core in its own process, started with ``autostep=False``; each
  call sends one ``CoreInput`` and waits for the one ``CoreOutputs`` that answers it;
- ``InProcessTransport``: the same call on an ``EngineCore`` of this process (``engine_process: false``).

A core that dies or stays silent past ``heartbeat_timeout`` during a call raises ``CoreLost``: the
caller ends its sequences with the reason; the next call starts a new core (counted by
``on_restart``) and goes on. All calls come from one thread (the model's worker): no locks
beyond the base class's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from backend.config import EngineConfig
from backend.engine_core.admission import UNLOADING_MESSAGE
from backend.engine_core.core import EngineCore
from backend.engine_core.engine_client import EngineClient, engine_outputs
from backend.engine_core.process_handle import (
    DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    CoreProcess,
    lost_request_message,
    report_restart,
)
from backend.engine_core.stub_watch import StubWatch
from backend.protocol.messages import AddRequest, CoreInput, CoreOutputs, CoreReady
from backend.protocol.outputs import EngineStats, RequestOutput

if TYPE_CHECKING:
    from backend.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
SHUTDOWN_WAIT_SECONDS = 10.0


class CoreLost(RuntimeError):
    """The engine core died or hung during a call; its requests are gone."""


class StepTransport(Protocol):
    """Where the step-on-demand client's engine runs."""

    def start(self) -> CoreReady: ...

    def iterate(self, adds: list[AddRequest], aborts: list[str],
                step: bool) -> tuple[list[RequestOutput], EngineStats]:
        """Adds, aborts and (``step``) one step; every output produced, and the statistics after."""

    def begin_drain(self, grace_seconds: float) -> None:
        """Requests still running ``grace_seconds`` from now end with an error naming the shutdown."""

    def shutdown(self, message: str) -> None:
        """Every request ends with ``message``; the engine stops."""


class StepOnDemandClient(EngineClient):
    def __init__(self, transport: StepTransport, max_queue_len: int, max_requests_per_client: int = 0):
        super().__init__(max_queue_len, max_requests_per_client=max_requests_per_client)
        self.transport = transport
        self._adds: list[AddRequest] = []
        self._aborts: list[str] = []
        self._sent = 0  # requests handed to the transport (admission's count of those taken)

    def start(self) -> CoreReady:
        return self.transport.start()

    def _queue(self, request: AddRequest) -> None:
        self._adds.append(request)

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def flush(self, step: bool = True) -> None:
        """One iteration: the queued adds and aborts, and one step unless ``step`` is False (aborts
        between Triton's iterations). Its EngineOutputs item is on ``outbox`` when this returns;
        raises what the transport raised (CoreLost: what was queued is gone with the core)."""
        adds, self._adds = self._adds, []
        aborts, self._aborts = self._aborts, []
        self._sent += len(adds)
        try:
            outputs, stats = self.transport.iterate(adds, aborts, step)
        except Exception:
            self.admission.engine_reported(0, self._sent)  # nothing waits in a lost core
            self.admission.clients.release_all()  # nor runs: the caller loses every request
            raise
        self.admission.engine_reported(stats.num_waiting, self._sent)
        self._post(engine_outputs(outputs, stats))

    def _drain(self, grace_seconds: float) -> None:
        self.transport.begin_drain(grace_seconds)

    def stop(self, timeout: float = 30.0, message: str | None = None) -> None:
        """The transport's shutdown bounds its own wait (``timeout`` is not needed here)."""
        message = message or UNLOADING_MESSAGE
        self.admission.close(message)
        self.transport.shutdown(message)
        self._post(None)


class InProcessTransport:
    """``engine_process: false``: the step-on-demand calls on an ``EngineCore`` of this process."""

    def __init__(self, engine: LLMEngine):
        self.core = EngineCore(engine)

    def start(self) -> CoreReady:
        engine = self.core.engine
        return CoreReady(os.getpid(), engine.vocab_size, engine.max_model_len, engine.num_kv_blocks)

    def iterate(self, adds: list[AddRequest], aborts: list[str], step: bool) -> tuple[list[RequestOutput], EngineStats]:
        return self.core.iterate(adds, aborts, step), self.core.stats()

    def begin_drain(self, grace_seconds: float) -> None:
        self.core.begin_drain(grace_seconds)

    def shutdown(self, message: str) -> None:
        self.core.fail_everything(message)
        self.core.engine.close()  # the offload tier writes what it has queued


class ProcessTransport:
    """The engine core in its own process, stepping only when a call asks (see the module docstring)."""

    def __init__(self, config: EngineConfig, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
                 on_restart: Callable[[str], None] | None = None, stub_watch: StubWatch | None = None):
        self.heartbeat_timeout = heartbeat_timeout
        self.on_restart = on_restart
        self.restarts = 0
        self._process = CoreProcess(config, autostep=False, stub_watch=stub_watch)
        self._lost = False
        self._drain_grace: float | None = None  # to send with the next call

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> CoreReady:
        return self._process.start(timeout)

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    def begin_drain(self, grace_seconds: float) -> None:
        """The grace goes with the next call: the core steps only then, so its deadline counts
        from there. (A core started after it has nothing to end: admission refuses new requests.)"""
        self._drain_grace = grace_seconds

    def iterate(self, adds: list[AddRequest], aborts: list[str], step: bool) -> tuple[list[RequestOutput], EngineStats]:
        """Sends the batch and waits for its answer; raises CoreLost (see the module docstring)."""
        if self._lost:
            self._process.kill()
            ready = self._process.start(START_TIMEOUT_SECONDS)  # a CoreStartError goes to the caller
            logger.warning("engine core restarted (pid %d)", ready.pid)
            self._lost = False
        drain, self._drain_grace = self._drain_grace, None
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
            deadline = time.monotonic() + SHUTDOWN_WAIT_SECONDS
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
