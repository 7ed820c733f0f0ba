"""The `llm` model: a decoupled Python model in front of the continuous-batching engine.

How one request flows: ``execute()`` (Triton's thread) reads and checks its tensors
(backend/triton/inputs.py, with the engine's one check), renders chat messages, and hands it to the
engine thread (backend/triton/engine_loop.py) together with its response state; the engine thread
tokenizes, adds and steps it (backend/engine.py); the response thread (backend/triton/responder.py)
sends its responses and its FINAL flag. execute() returns None at once and never raises: a bad
request gets an error response naming the field, the others go on. This follows vllm_backend's
threads and TensorRT-LLM's tensor names.
"""

from __future__ import annotations

import itertools
import logging
import time

from backend.config import ConfigError
from backend.triton.helpers import input_getter, load_llm_config, send_error, set_utf8_locale

logger = logging.getLogger(__name__)

# Parameters of config.pbtxt that belong to this glue, not to the engine.
GLUE_PARAMETERS = frozenset({"shutdown_grace_seconds", "triton_http_url"})
# Below Triton's default --exit-timeout-secs (30 s), which ends the server whatever is in flight.
DEFAULT_SHUTDOWN_GRACE_SECONDS = 20.0


def shutdown_grace_seconds(parameters: dict[str, str]) -> float:
    raw = parameters.get("shutdown_grace_seconds", "")
    if not raw.strip():
        return DEFAULT_SHUTDOWN_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"parameter 'shutdown_grace_seconds': expected a number of seconds, got {raw!r}") from None
    if not (value >= 0 and value < float("inf")):
        raise ConfigError(f"parameter 'shutdown_grace_seconds': must be a finite number >= 0, got {raw!r}")
    return value


class TritonPythonModel:
    """Triton's entry points; model_repository/llm/1/model.py re-exports this class."""

    def initialize(self, args: dict) -> None:
        set_utf8_locale()
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 (only inside the stub)

        from backend.engine import LLMEngine  # noqa: PLC0415
        from backend.triton.engine_loop import EngineLoop  # noqa: PLC0415
        from backend.triton.metrics import TritonMetrics  # noqa: PLC0415
        from backend.triton.responder import Responder  # noqa: PLC0415

        self.pb = pb_utils
        self.model_name, self.config, parameters = load_llm_config(pb_utils, args, GLUE_PARAMETERS)
        grace = shutdown_grace_seconds(parameters)
        self.engine = LLMEngine(self.config)
        self.metrics = TritonMetrics(pb_utils, self.model_name)
        self.loop = EngineLoop(self.engine, self.config.scheduler.max_queue_len)
        self.responder = Responder(pb_utils, self.loop, self.metrics, self.engine.tokenizer)
        self._ids = itertools.count()
        self.loop.start()
        self.responder.start()
        self.unload_watcher = self._start_unload_watcher(parameters, str(args.get("model_version", "")), grace)

    def _start_unload_watcher(self, parameters: dict[str, str], version: str, grace: float):
        """Drains on server stop or unload (backend/triton/drain.py); None when Triton's HTTP is off."""
        from backend.triton import drain  # noqa: PLC0415

        url = parameters.get("triton_http_url", "").strip() or drain.http_url_from_command_line(
            drain.parent_command_line())
        if not url or url == "none":
            logger.warning("no Triton HTTP endpoint to watch: requests in flight at shutdown are not drained")
            return None
        watcher = drain.UnloadWatcher(drain.http_readiness_probe(url, self.model_name, version),
                                      lambda: self.loop.begin_drain(grace))
        watcher.start()
        return watcher

    def execute(self, requests):
        """Parses and queues each request; returns None at once. Never raises.

        An exception escaping execute() makes the Python backend answer every request of the batch
        with it and release them, while the responder still holds the ones already queued (a
        SIGSEGV in is_cancelled, measured): so each request's failure stays its own. Until a request
        is handed to the responder (atomically with queueing it) only this thread answers it; after
        that only the responder does.
        """
        for request in requests:
            sender = None
            try:
                sender = request.get_response_sender()
                self._admit(request, sender)
            except Exception as exc:
                logger.exception("reading a request failed")
                if sender is not None:
                    try:
                        send_error(self.pb, sender, f"internal error while reading the request: "
                                   f"{type(exc).__name__}: {exc}", self.pb.TritonError.INTERNAL)
                    except Exception:
                        logger.exception("sending an error response failed")
        return None

    def _admit(self, request, sender) -> None:
        from backend.engine import EngineInputError  # noqa: PLC0415
        from backend.triton.engine_loop import BusyError, PendingRequest  # noqa: PLC0415
        from backend.triton.inputs import InputError, parse_request  # noqa: PLC0415
        from backend.triton.responder import ActiveRequest  # noqa: PLC0415
        from backend.triton.response_state import ResponseState  # noqa: PLC0415

        pb = self.pb
        arrival_time = time.monotonic()
        request_id = f"{self.model_name}-{next(self._ids)}"
        try:
            parsed = parse_request(input_getter(pb, request), self.config.scheduler.default_max_tokens,
                                   self.engine.check_sampling_params, self.config.model.prompt_byte_limit)
            prompt, add_special_tokens = parsed.prompt, True
            if parsed.messages is not None:
                prompt, add_special_tokens = self.engine.render_chat(parsed.messages), False
        except (InputError, EngineInputError) as exc:
            send_error(pb, sender, str(exc), pb.TritonError.INVALID_ARG)
            return
        state = ResponseState(request_id, parsed.stream, parsed.exclude_input_in_output, prompt, arrival_time,
                              returns=parsed.returns, wants_logprobs=parsed.sampling_params.logprobs)
        pending = PendingRequest(request_id, prompt, parsed.sampling_params, arrival_time, add_special_tokens)
        try:
            self.loop.submit(pending, on_accept=lambda: self.responder.register(ActiveRequest(state, sender)))
        except BusyError as exc:
            send_error(pb, sender, str(exc), pb.TritonError.UNAVAILABLE)

    def finalize(self) -> None:
        """Stops the threads: requests in flight get an error response and their FINAL flag."""
        watcher = getattr(self, "unload_watcher", None)
        if watcher is not None:
            watcher.stop()
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=30.0)
            self.responder.join(timeout=30.0)
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
