"""The body of every serving loop around an ``LLMEngine``: new requests, aborts, draining, one step.

The in-thread `llm` client (backend/engine_core/in_thread.py), the engine-core process
(backend/engine_core/core_process.py) and the in-process transport of `llm_iterative`
(backend/engine_core/step_on_demand.py) all call ``iterate``; they differ only in where requests
come from and where outputs go. Whether a request is taken at all (busy, draining) was decided in
the front end (backend/engine_core/admission.py); the drain's deadline is kept here. Requests
arrive checked and tokenized (backend/engine/input_processor.py); what can only be checked against
the model and the KV pool (the prompt's length) is checked here, and a refused request gets its
final output with the error like any other. Single-threaded: whoever calls it owns the engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from backend.engine.input_processor import EngineInputError
from backend.protocol.messages import AddRequest
from backend.protocol.outputs import EngineStats, FinishReason, RequestOutput

if TYPE_CHECKING:  # the engine (and torch) is imported by whoever makes one: never by the stub
    from backend.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def error_output(request_id: str, message: str, arrival_time: float = 0.0) -> RequestOutput:
    """The final output of a request that ends without (more) tokens."""
    return RequestOutput(
        request_id=request_id, new_token_ids=[], text="", finished=True, finish_reason=FinishReason.ERROR,
        num_prompt_tokens=0, num_output_tokens=0, error=message, arrival_time=arrival_time,
    )


class EngineCore:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.num_adds_seen = 0  # requests received, refused ones included
        self._drain_deadline: float | None = None  # monotonic; set once draining starts
        self._drain_grace = 0.0

    def begin_drain(self, grace_seconds: float) -> None:
        """Requests still running ``grace_seconds`` from now end with an error naming the shutdown.
        Idempotent: the first call sets the deadline."""
        if self._drain_deadline is None:
            self._drain_grace = grace_seconds
            self._drain_deadline = time.monotonic() + grace_seconds
            logger.warning("draining: requests in flight get up to %g s to finish", grace_seconds)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def iterate(self, adds: list[AddRequest], aborts: list[str], step: bool = True) -> list[RequestOutput]:
        """Adds, aborts, ends what outlived the drain deadline, and (``step``) runs one step.

        Returns every output produced: refusals, abort finals, the step's tokens. Raises only
        WorkerLost (a tensor-parallel rank died: no step can run until every rank restarts).
        """
        outputs: list[RequestOutput] = []
        self.num_adds_seen += len(adds)
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            message = (f"shutting down (server stop or model unload): the request was ended after "
                       f"the {self._drain_grace:g} s grace period (parameter shutdown_grace_seconds)")
            outputs.extend(error_output(r.request_id, message, r.arrival_time) for r in adds)
            adds = []
            outputs.extend(self.engine.fail_all(message))
        for request in adds:
            error = self._add(request)
            if error is not None:
                outputs.append(error_output(request.request_id, error, request.arrival_time))
        for request_id in aborts:
            output = self.engine.abort_request(request_id)
            if output is not None:
                outputs.append(output)
        if step and self.engine.has_unfinished_requests():
            outputs.extend(self.engine.step_or_fail_all().outputs)
        else:
            self.engine.release_transferred()  # a prefill engine's pulled or timed-out blocks, while idle
        return outputs

    def fail_everything(self, message: str, adds: list[AddRequest] = ()) -> list[RequestOutput]:
        """Unload: every request, the engine's and those not added yet, ends with ``message``."""
        self.num_adds_seen += len(adds)
        outputs = [error_output(r.request_id, message, r.arrival_time) for r in adds]
        outputs.extend(self.engine.fail_all(message))
        return outputs

    def _add(self, request: AddRequest) -> str | None:
        """Adds a request to the engine; returns the error message when it is refused."""
        try:
            self.engine.add_request(
                request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params, arrival_time=request.arrival_time,
                check=False,  # the front end made the one check before sending it
            )
            return None
        except EngineInputError as exc:
            return str(exc)
        except Exception as exc:  # must not end the loop
            logger.exception("adding request %s failed", request.request_id)
            return f"internal error while adding the request: {exc}"
