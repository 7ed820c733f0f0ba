"""The one interface through which the front end (a Triton model) reaches the engine core.

Three implementations, picked by ``make_engine_client`` (backend/engine_core/make_client.py):

- ``InThreadClient`` (backend/engine_core/in_thread.py): the engine on a thread of this process,
  stepping on its own (`llm` with ``engine_process: false``);
- ``ProcessClient`` (backend/engine_core/process_client.py): the engine core in its own process,
  stepping on its own (`llm`, the default);
- ``StepOnDemandClient`` (backend/engine_core/step_on_demand.py): the core steps once per
  ``flush()``, over a transport that is either its own process or an engine in this process
  (`llm_iterative`, whose iterations Triton's sequence batcher decides).

What a request goes through, the same on all three:

1. ``submit(request, on_accept)``: admission control (``self.admission``,
   backend/engine_core/admission.py) takes it or raises BusyError with the message the client is
   told; ``on_accept()`` runs before the engine can produce anything for it, so whoever answers it
   knows it first. It is queued, not sent.
2. ``flush()``: everything queued goes to the engine together (execute() calls it once per batch).
   Free-running clients return at once; the step-on-demand client runs one iteration here
   (``flush(step=False)``: the adds and aborts without a step) and raises CoreLost when its core
   died under the call.
3. Outputs arrive on ``outbox`` as ``EngineOutputs`` items (one per engine iteration: its outputs,
   the engine's statistics after it, and when this process had them), each request's in order and
   ending with exactly one ``finished`` output (the free-running clients send an error output for
   each request of a core that died, and start a new core); ``None`` once the client has stopped.
   The step-on-demand client's item is there when ``flush()`` returns.

``abort(request_id)`` ends a request before the engine's next step; ``begin_drain(grace)`` refuses
new requests and has the core end what still runs after ``grace`` seconds; ``stop()`` ends every
request with an error and the engine with them. Nothing here imports Triton or torch.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from backend.engine_core.admission import AdmissionControl
from backend.protocol.messages import AddRequest, CoreReady
from backend.protocol.outputs import EngineStats, RequestOutput


class EngineOutputs(NamedTuple):
    """One iteration's outputs as the front end takes them from ``outbox``."""

    outputs: list[RequestOutput]
    stats: EngineStats
    received_at: float  # time.monotonic() when this process had them: the tokens' time for ITL metrics


def engine_outputs(outputs: list[RequestOutput], stats: EngineStats, received_at: float | None = None) -> EngineOutputs:
    return EngineOutputs(outputs, stats, time.monotonic() if received_at is None else received_at)


def empty_stats(num_kv_blocks: int = 0) -> EngineStats:
    """The statistics of an engine with nothing in it (a core that is gone or just started)."""
    return EngineStats(0, 0, 0.0, num_kv_blocks, 0, 0, 0)


class EngineClient(abc.ABC):
    """See the module docstring. ``_lock`` is held while a request is admitted and queued."""

    def __init__(self, max_queue_len: int, engine_up: bool = True, max_requests_per_client: int = 0):
        self.admission = AdmissionControl(max_queue_len, engine_up, max_requests_per_client)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()

    @abc.abstractmethod
    def start(self) -> CoreReady:
        """Starts the engine (raises CoreStartError naming why it did not come up); what the front
        end needs to check requests is in the answer."""

    def submit(self, request: AddRequest, on_accept: Callable[[], None] | None = None) -> None:
        """Admission control decides (BusyError); an accepted request is queued for ``flush``."""
        with self._lock:
            self.admission.admit(on_accept, request.sampling_params.user, request.request_id)
            self._queue(request)

    def _post(self, item: EngineOutputs | None) -> None:
        """Puts an item on ``outbox``; a request's final output gives its client's seat back."""
        if item is not None:
            for output in item.outputs:
                if output.finished:
                    self.admission.clients.release(output.request_id)
        self.outbox.put(item)

    @abc.abstractmethod
    def _queue(self, request: AddRequest) -> None:
        """Keeps an admitted request for the next ``flush`` (called under ``_lock``)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Hands every queued request to the engine (see the module docstring)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Ends the request before the engine's next step; its final output has finish reason abort."""

    def begin_drain(self, grace_seconds: float) -> None:
        """Server stop or unload: new requests are refused, and those still running
        ``grace_seconds`` from now end with an error naming the shutdown. The first call counts."""
        if self.admission.begin_drain(grace_seconds):
            self._drain(grace_seconds)

    @abc.abstractmethod
    def _drain(self, grace_seconds: float) -> None:
        """Hands the drain's grace period to the engine core (once)."""

    @abc.abstractmethod
    def stop(self, timeout: float = 30.0, message: str | None = None) -> None:
        """Every unfinished request ends with an error naming ``message`` (default: the model is
        being unloaded), the engine stops, then ``None`` is posted."""
