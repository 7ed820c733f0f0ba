"""The `llm` model: a decoupled Python model in front of the continuous-batching engine.

How one request flows: ``execute()`` (Triton's thread) admits it (backend/triton/admission.py:
tensors read and checked, chat rendered, tokenized, submitted to the engine client) and hands it to
the response thread; one ``flush()`` per batch sends the batch's requests to the engine together.
The engine runs on its own, in its own process by default (``engine_process: true``,
backend/engine_core/process_client.py: the stub's threads then share no GIL with the forward pass,
and a crashing engine costs its requests an error, not the server), or on a thread of this process
(backend/engine_core/in_thread.py, the same interface). The response thread
(backend/triton/responder.py) sends each request's responses and its FINAL flag. execute()
returns None at once and never raises: a bad request gets an error response naming the field, the
others go on. This follows vllm_backend's threads and TensorRT-LLM's tensor names.
"""

from __future__ import annotations

import itertools
import logging
import time

from backend.triton.admission import RequestAdmission
from backend.triton.engine_model import EngineModel
from backend.triton.responder import ActiveRequest, Responder

logger = logging.getLogger(__name__)


class TritonPythonModel(EngineModel):
    """Triton's entry points; model_repository/llm/1/model.py re-exports this class."""

    def start_serving(self) -> None:
        self.admission = RequestAdmission(self.pb, self.engine, self.inputs, self.config.model.prompt_byte_limit, self.stream_interval,
                                          self.client_priorities)
        self.responder = Responder(self.pb, self.engine, self.metrics, self.inputs.tokenizer,
                                   coalesce=self.response_coalescing)
        self._ids = itertools.count()
        self.responder.start()

    def begin_drain(self, grace_seconds: float) -> None:
        self.engine.begin_drain(grace_seconds)

    def execute(self, requests):
        """Admits each request and hands the batch to the engine; returns None at once. Never raises.

        An exception escaping execute() makes the Python backend answer every request of the batch
        with it and release them, while the responder still holds the ones already queued (a
        SIGSEGV in is_cancelled): so each request's failure stays its own. Until a request is
        handed to the responder (atomically with queueing it) only this thread answers it; after
        that only the responder does.
        """
        for request in requests:
            try:
                sender = request.get_response_sender()
            except Exception:
                logger.exception("reading a request failed")
                continue
            self.admission.admit(request, sender, f"{self.model_name}-{next(self._ids)}", time.monotonic(),
                                 on_accept=self._hand_to_responder)
        try:
            self.engine.flush()  # the batch's requests go to the engine together
        except Exception:
            logger.exception("handing the batch to the engine failed")
        return None

    def _hand_to_responder(self, state, sender) -> None:
        self.responder.register(ActiveRequest(state, sender))

    def stop_serving(self) -> None:
        """Stops the threads: requests in flight get an error response and their FINAL flag."""
        self.engine.stop(timeout=30.0)
        self.responder.join(timeout=30.0)
