"""The process engine client (`llm`, the default): the engine core in its own process, stepping on its own.

``flush``/``abort``/``begin_drain``/``stop`` send ``CoreInput`` messages over ZeroMQ (a lock
serializes the callers: Triton's thread, the responder, the drain watcher); a reader thread turns
each ``CoreOutputs`` into one ``EngineOutputs`` item of ``outbox`` (the interface is
backend/engine_core/engine_client.py). The reader also watches the core:

- the process exited (kill -9, a CUDA error, out of memory): seen within ``POLL_SECONDS``;
- it sent nothing for ``heartbeat_timeout`` seconds (it sends at least every 0.5 s, so it hangs):
  it is killed.

Either way every request in flight gets one error output naming what happened, ``on_restart`` is
called (the restart counter), and a new core is started; admission control refuses requests
meanwhile. Detokenization and stop strings stay in the core: they are a small part of a decode
step (perf/RESULTS.md), and a stop string found where the token is made stops it at once, with no
abort round trip and no tokens generated past it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from backend.config import EngineConfig
from backend.engine_core.admission import UNLOADING_MESSAGE
from backend.engine_core.core import error_output
from backend.engine_core.engine_client import EngineClient, empty_stats, engine_outputs
from backend.engine_core.process_handle import (
    DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    CoreProcess,
    CoreStartError,
    lost_request_message,
    report_restart,
)
from backend.engine_core.stub_watch import StubWatch
from backend.protocol.messages import AddRequest, CoreInput, CoreOutputs, CoreReady

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
RESTART_BACKOFF_SECONDS = 2.0
STOP_WAIT_SECONDS = 10.0  # after a shutdown message, how long the reader waits for the core's last one


class ProcessClient(EngineClient):
    def __init__(self, config: EngineConfig, max_queue_len: int,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
                 on_restart: Callable[[str], None] | None = None,
                 on_ipc: Callable[[float], None] | None = None, stub_watch: StubWatch | None = None,
                 max_requests_per_client: int = 0):
        super().__init__(max_queue_len, engine_up=False, max_requests_per_client=max_requests_per_client)  # refused until start()
        self.heartbeat_timeout = heartbeat_timeout
        self.on_restart = on_restart  # called with the reason, from the reader thread
        self.on_ipc = on_ipc  # called with each step message's IPC seconds, from the reader thread
        self.restarts = 0
        self._process = CoreProcess(config, autostep=True, stub_watch=stub_watch)
        # self._lock (the base class's): the input socket and everything below
        self._active: set[str] = set()  # submitted, no final output seen yet
        self._outgoing: list[AddRequest] = []  # submitted, not sent yet (see flush)
        self._available = False  # a core is up and reachable
        self._last_posted_stats = None  # the statistics last handed to the responder (the metrics' source)
        self._thread = threading.Thread(target=self._run, name="llm-engine-core-reader", daemon=True)

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> CoreReady:
        """Starts the core (raises CoreStartError naming why it did not come up) and the reader."""
        ready = self._process.start(timeout)
        self._available = True
        self.admission.engine_up()
        self._thread.start()
        return ready

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    # ------------------------------------------------------------------------------------------
    def _queue(self, request: AddRequest) -> None:
        self._active.add(request.request_id)
        self._outgoing.append(request)

    def flush(self) -> None:
        """Sends the requests submitted since the last flush, in one message."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._outgoing and self._available:
            self._process.send(CoreInput(adds=self._outgoing))  # a lost core is the reader's to notice
        self._outgoing = []

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._active and self._available:
                self._flush_locked()  # the abort must not overtake its request
                self._process.send(CoreInput(aborts=[request_id]))

    def _drain(self, grace_seconds: float) -> None:
        with self._lock:
            if self._available:
                self._process.send(CoreInput(drain_grace=grace_seconds))

    def stop(self, timeout: float = 30.0, message: str | None = None) -> None:
        message = message or UNLOADING_MESSAGE
        with self._lock:
            self.admission.close(message)
            if self._available:
                self._process.send(CoreInput(shutdown=message))
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            self._process.terminate(timeout=5.0)

    # ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        last_heard = time.monotonic()
        stop_deadline = None
        try:
            while True:
                message = self._process.receive(POLL_SECONDS)
                now = time.monotonic()
                if message is not None:
                    last_heard = now
                    if isinstance(message, CoreOutputs):
                        self._deliver(message, now)
                        if message.final:
                            return
                    continue
                if self.admission.closed_message is not None:
                    stop_deadline = stop_deadline or now + STOP_WAIT_SECONDS
                    if self._process.exit_code() is not None or now > stop_deadline:
                        return
                    continue
                if self._process.exit_code() is not None:
                    self._recover(f"the engine core process died ({self._process.describe_exit()})")
                    last_heard = time.monotonic()
                elif now - last_heard > self.heartbeat_timeout:
                    self._process.kill()
                    self._recover(f"the engine core stopped answering for {self.heartbeat_timeout:g} s "
                                  "(parameter engine_heartbeat_timeout_seconds) and was killed")
                    last_heard = time.monotonic()
        except Exception:
            logger.exception("the engine-core reader failed")
        finally:
            self._fail_active(self.admission.closed_message or UNLOADING_MESSAGE)
            self._post(None)

    def _deliver(self, message: CoreOutputs, now: float) -> None:
        if message.stepped and self.on_ipc is not None:
            self.on_ipc(max(0.0, now - message.sent_at))
        with self._lock:
            self.admission.engine_reported(message.stats.num_waiting, message.num_adds_seen)
            for output in message.outputs:
                if output.finished:
                    self._active.discard(output.request_id)
        # A heartbeat whose statistics changed (an idle prefill engine freed kept blocks) updates the metrics too.
        if message.outputs or message.stepped or message.stats != self._last_posted_stats:
            self._post(engine_outputs(message.outputs, message.stats, now))
            self._last_posted_stats = message.stats

    def _fail_active(self, message: str) -> None:
        with self._lock:
            failed, self._active = self._active, set()
        if failed:
            self._post(engine_outputs([error_output(request_id, message) for request_id in failed], empty_stats()))

    def _recover(self, reason: str) -> None:
        """The core is gone: its requests end with ``reason``, and a new core starts."""
        logger.error("%s: failing its requests and starting a new one", reason)
        with self._lock:
            self._available = False
            self.admission.engine_down()
            self._outgoing = []  # in _active: failed below
        self._fail_active(lost_request_message(reason))
        self.restarts += 1
        report_restart(self.on_restart, reason)
        while self.admission.closed_message is None:
            try:
                ready = self._process.start(START_TIMEOUT_SECONDS)  # nobody sends while not _available
                with self._lock:
                    self._available = True
                    self.admission.engine_up()
                    if self.admission.draining:
                        self._process.send(CoreInput(drain_grace=0.0))
                logger.warning("engine core restarted (pid %d)", ready.pid)
                self._post(engine_outputs([], empty_stats(ready.num_kv_blocks)))
                return
            except CoreStartError:
                logger.exception("restarting the engine core failed; retrying in %g s", RESTART_BACKOFF_SECONDS)
                time.sleep(RESTART_BACKOFF_SECONDS)
