"""The `llm` model's side of the engine-core process: the interface of EngineLoop, over ZeroMQ.

``submit``/``abort``/``begin_drain``/``stop`` send ``CoreInput`` messages (a lock serializes the
callers: Triton's thread, the responder, the drain watcher); a reader thread turns each
``CoreOutputs`` into one ``(outputs, stats)`` item of ``outbox``, as the in-thread loop does, so the
responder cannot tell them apart. The reader also watches the core:

- the process exited (kill -9, a CUDA error, out of memory): seen within ``POLL_SECONDS``;
- it sent nothing for ``heartbeat_timeout`` seconds (it sends at least every 0.5 s, so it hangs):
  it is killed.

Either way every request in flight gets one error output naming what happened, ``on_restart`` is
called (the restart counter), and a new core is started; requests arriving meanwhile are refused
as busy. Detokenization and stop strings stay in the core: measured on this machine they cost
0.7% of a decode step (perf.profile_step: 0.49 ms of 72.7 ms at 32 sequences, SmolLM2), and a stop string found where the token is made
stops it at once, with no abort round trip and no tokens generated past it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from backend.config import EngineConfig
from backend.engine.outputs import EngineStats
from backend.engine_core.core import DRAINING_MESSAGE, BusyError, busy_message, error_output
from backend.engine_core.messages import AddRequest, CoreInput, CoreOutputs, CoreReady
from backend.engine_core.process_handle import (
    CoreProcess,
    CoreStartError,
    lost_request_message,
    report_restart,
)
from backend.engine_core.stub_watch import StubWatch

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 60.0  # a slow step (a long prefill on a big model) is not a hang
START_TIMEOUT_SECONDS = 600.0  # loading a model
RESTART_BACKOFF_SECONDS = 2.0


def empty_stats(num_kv_blocks: int = 0) -> EngineStats:
    return EngineStats(0, 0, 0.0, num_kv_blocks, 0, 0, 0)


class EngineCoreClient:
    def __init__(self, config: EngineConfig, max_queue_len: int,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
                 on_restart: Callable[[str], None] | None = None,
                 on_ipc: Callable[[float], None] | None = None, stub_watch: StubWatch | None = None):
        self.max_queue_len = max_queue_len
        self.heartbeat_timeout = heartbeat_timeout
        self.on_restart = on_restart  # called with the reason, from the reader thread
        self.on_ipc = on_ipc  # called with each step message's IPC seconds, from the reader thread
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.restarts = 0
        self._process = CoreProcess(config, autostep=True, stub_watch=stub_watch)
        self._lock = threading.Lock()  # the input socket and everything below
        self._active: set[str] = set()  # submitted, no final output seen yet
        self._outgoing: list[AddRequest] = []  # submitted, not sent yet (see flush)
        self._adds_sent = 0  # to this core
        self._adds_seen = 0  # by this core, as of its last message
        self._num_waiting = 0  # the core's, as of its last message
        self._available = False  # a core is up and takes requests
        self._draining = False
        self._stopping = False
        self._shutdown_message = "the model is being unloaded"
        self._thread = threading.Thread(target=self._run, name="llm-engine-core-reader", daemon=True)

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> CoreReady:
        """Starts the core (raises CoreStartError naming why it did not come up) and the reader."""
        ready = self._process.start(timeout)
        self._available = True
        self._thread.start()
        return ready

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    # ------------------------------------------------------------------------------------------
    def submit(self, request: AddRequest, on_accept: Callable[[], None] | None = None) -> None:
        """Queues a request for the core (``flush`` sends it); raises BusyError beyond max_queue_len
        waiting, while draining or restarting. ``on_accept`` runs first (see EngineLoop.submit)."""
        with self._lock:
            if self._stopping:
                raise BusyError(self._shutdown_message)
            if self._draining:
                raise BusyError(DRAINING_MESSAGE)
            if not self._available:
                raise BusyError("the engine core is restarting after a failure; retry in a few seconds")
            waiting = self._num_waiting + self._adds_sent - self._adds_seen
            if waiting >= self.max_queue_len:
                raise BusyError(busy_message(waiting, self.max_queue_len))
            if on_accept is not None:
                on_accept()
            self._active.add(request.request_id)
            self._adds_sent += 1
            self._outgoing.append(request)

    def flush(self) -> None:
        """Sends the requests submitted since the last flush, in one message (execute() calls it
        once per batch Triton hands it)."""
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

    def begin_drain(self, grace_seconds: float) -> None:
        with self._lock:
            if not self._draining:
                self._draining = True
                if self._available:
                    self._process.send(CoreInput(drain_grace=grace_seconds))

    def stop(self, timeout: float = 30.0, message: str | None = None) -> None:
        """Every unfinished request gets an error output, then ``None`` is posted and the core is gone."""
        with self._lock:
            if message:
                self._shutdown_message = message
            self._stopping = True
            if self._available:
                self._process.send(CoreInput(shutdown=self._shutdown_message))
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
                if self._stopping:
                    stop_deadline = stop_deadline or now + 10.0
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
            self._fail_active(self._shutdown_message)
            self.outbox.put(None)

    def _deliver(self, message: CoreOutputs, now: float) -> None:
        if message.stepped:
            if self.on_ipc is not None:
                self.on_ipc(max(0.0, now - message.sent_at))
        with self._lock:
            self._adds_seen = message.num_adds_seen
            self._num_waiting = message.stats.num_waiting
            for output in message.outputs:
                if output.finished:
                    self._active.discard(output.request_id)
        if message.outputs or message.stepped:
            self.outbox.put((message.outputs, message.stats))

    def _fail_active(self, message: str) -> None:
        with self._lock:
            failed, self._active = self._active, set()
        if failed:
            self.outbox.put(([error_output(request_id, message) for request_id in failed], empty_stats()))

    def _recover(self, reason: str) -> None:
        """The core is gone: its requests end with ``reason``, and a new core starts."""
        logger.error("%s: failing its requests and starting a new one", reason)
        with self._lock:
            self._available = False
            self._outgoing = []  # in _active: failed below
        self._fail_active(lost_request_message(reason))
        self.restarts += 1
        report_restart(self.on_restart, reason)
        while not self._stopping:
            try:
                ready = self._process.start(START_TIMEOUT_SECONDS)  # nobody sends while not _available
                with self._lock:
                    self._adds_sent = self._adds_seen = self._num_waiting = 0
                    self._available = True
                    if self._draining:
                        self._process.send(CoreInput(drain_grace=0.0))
                logger.warning("engine core restarted (pid %d)", ready.pid)
                self.outbox.put(([], empty_stats(ready.num_kv_blocks)))
                return
            except CoreStartError:
                logger.exception("restarting the engine core failed; retrying in %g s", RESTART_BACKOFF_SECONDS)
                time.sleep(RESTART_BACKOFF_SECONDS)
