"""The in-thread engine client (`llm` with ``engine_process: false``): the engine on a thread of this process.

Everything that touches the engine (adding, aborting, stepping) happens on this one thread, so the
engine needs no locks; the loop body is ``EngineCore.iterate`` (backend/engine_core/core.py), the
same one the engine-core process runs. ``flush`` wakes the thread for the requests queued since
the last one; results go to ``outbox`` (backend/engine_core/engine_client.py has the interface).
Made with an ``LLMEngine``, so only the ``engine_process: false`` path imports this module.
"""

from __future__ import annotations

import logging
import os
import threading

from backend.engine.llm_engine import LLMEngine
from backend.engine_core.admission import UNLOADING_MESSAGE
from backend.engine_core.core import EngineCore
from backend.engine_core.engine_client import EngineClient, engine_outputs
from backend.protocol.messages import AddRequest, CoreReady

IDLE_TICK_SECONDS = 0.5  # an idle engine still iterates this often (as the core process's heartbeat)

logger = logging.getLogger(__name__)


class InThreadClient(EngineClient):
    def __init__(self, engine: LLMEngine, max_queue_len: int, max_requests_per_client: int = 0):
        super().__init__(max_queue_len, max_requests_per_client=max_requests_per_client)
        self.core = EngineCore(engine)
        self._cond = threading.Condition(self._lock)
        self._pending: list[AddRequest] = []
        self._aborts: list[str] = []
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)

    def start(self) -> CoreReady:
        self._thread.start()
        engine = self.core.engine
        return CoreReady(os.getpid(), engine.vocab_size, engine.max_model_len, engine.num_kv_blocks)

    def _queue(self, request: AddRequest) -> None:
        self._pending.append(request)

    def flush(self) -> None:
        with self._cond:
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def _drain(self, grace_seconds: float) -> None:
        with self._cond:
            self._cond.notify()  # the loop hands admission's grace to the core

    def stop(self, timeout: float = 30.0, message: str | None = None) -> None:
        self.admission.close(message or UNLOADING_MESSAGE)
        with self._cond:
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------
    def _has_news(self) -> bool:
        core, admission = self.core, self.admission
        return bool(self._pending or self._aborts or admission.closed_message is not None or core.has_work()
                    or (admission.draining and not core.draining))

    def _run(self) -> None:
        core = self.core
        last_posted = None  # the stats last handed to the responder (the metrics are set from them)
        try:
            while True:
                with self._cond:
                    while not self._has_news():
                        if not self._cond.wait(IDLE_TICK_SECONDS):
                            break  # idle: one iteration for the core's housekeeping (kept blocks' timeouts)
                    pending, self._pending = self._pending, []
                    aborts, self._aborts = self._aborts, []
                stop_message = self.admission.closed_message
                if stop_message is not None:
                    self._post(engine_outputs(core.fail_everything(stop_message, pending), core.stats()))
                    core.engine.close()  # the offload tier writes what it has queued
                    return
                if self.admission.draining:
                    core.begin_drain(self.admission.drain_grace)  # idempotent: the first call counts
                outputs = core.iterate(pending, aborts)
                stats = core.stats()
                self.admission.engine_reported(stats.num_waiting, core.num_adds_seen)
                if outputs or pending or aborts or stats != last_posted:
                    self._post(engine_outputs(outputs, stats))
                    last_posted = stats
        finally:
            self._post(None)
