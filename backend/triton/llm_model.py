"""The `llm` model: a decoupled Python model in front of the continuous-batching engine.

How one request flows: ``execute()`` (Triton's thread) reads and checks its tensors
(backend/triton/inputs.py, with the one check of backend/engine/input_processor.py), renders chat
messages, tokenizes, and hands the request to the engine together with its response state. The
engine runs in its own process by default (``engine_process: true``, backend/engine_core: the
stub's threads then no longer share a GIL with the forward pass, and a crashing engine costs its
requests an error, not the server), or on a thread of this process (backend/triton/engine_loop.py,
same interface). The response thread (backend/triton/responder.py) sends each request's responses
and its FINAL flag. execute() returns None at once and never raises: a bad
request gets an error response naming the field, the others go on. This follows vllm_backend's
threads and TensorRT-LLM's tensor names.
"""

from __future__ import annotations

import itertools
import logging
import time

from backend.triton.helpers import (
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    engine_process_options,
    input_getter,
    load_llm_config,
    seconds_parameter,
    send_error,
    set_utf8_locale,
    start_engine_core,
    start_unload_watcher,
    stub_watch,
    triton_readiness_url,
)

logger = logging.getLogger(__name__)


class TritonPythonModel:
    """Triton's entry points; model_repository/llm/1/model.py re-exports this class."""

    def initialize(self, args: dict) -> None:
        set_utf8_locale()
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 (only inside the stub)

        from backend.triton.metrics import TritonMetrics  # noqa: PLC0415
        from backend.triton.responder import Responder  # noqa: PLC0415

        self.pb = pb_utils
        self.model_name, self.config, parameters = load_llm_config(pb_utils, args)
        grace = seconds_parameter(parameters, "shutdown_grace_seconds", DEFAULT_SHUTDOWN_GRACE_SECONDS)
        use_process, heartbeat_timeout = engine_process_options(parameters)
        self.metrics = TritonMetrics(pb_utils, self.model_name)
        version = str(args.get("model_version", ""))
        ready_url = triton_readiness_url(parameters, self.model_name, version)
        if use_process:
            self.loop, self.inputs = self._start_engine_core(heartbeat_timeout,
                                                             stub_watch(parameters, ready_url))
        else:
            self.loop, self.inputs = self._start_engine_thread()
        self.responder = Responder(pb_utils, self.loop, self.metrics, self.inputs.tokenizer)
        self._ids = itertools.count()
        self.responder.start()
        self.unload_watcher = start_unload_watcher(ready_url, lambda: self.loop.begin_drain(grace))

    def _start_engine_core(self, heartbeat_timeout: float, watch):
        """The engine in its own process (backend/engine_core); tokenizing and checks stay here."""
        from backend.engine_core.client import EngineCoreClient  # noqa: PLC0415

        metrics = self.metrics
        client = EngineCoreClient(self.config, self.config.scheduler.max_queue_len, heartbeat_timeout,
                                  on_restart=lambda reason: metrics.engine_restarts.increment(1),
                                  on_ipc=metrics.core_ipc.observe, stub_watch=watch)
        return client, start_engine_core(client, self.model_name, self.config.model.tokenizer_dir)

    def _start_engine_thread(self):
        """``engine_process: false``: the engine on a thread of this process (debugging, comparison)."""
        from backend.engine.llm_engine import LLMEngine  # noqa: PLC0415
        from backend.triton.engine_loop import EngineLoop  # noqa: PLC0415

        engine = LLMEngine(self.config)
        loop = EngineLoop(engine, self.config.scheduler.max_queue_len)
        loop.start()
        return loop, engine.input_processor

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
        try:
            self.loop.flush()  # the batch's requests go to the engine in one message
        except Exception:
            logger.exception("handing the batch to the engine failed")
        return None

    def _admit(self, request, sender) -> None:
        from backend.engine.input_processor import EngineInputError  # noqa: PLC0415
        from backend.engine_core.messages import AddRequest  # noqa: PLC0415
        from backend.triton.engine_loop import BusyError  # noqa: PLC0415
        from backend.triton.inputs import InputError, parse_request  # noqa: PLC0415
        from backend.triton.responder import ActiveRequest  # noqa: PLC0415
        from backend.triton.response_state import ResponseState  # noqa: PLC0415

        pb = self.pb
        arrival_time = time.monotonic()
        request_id = f"{self.model_name}-{next(self._ids)}"
        try:
            parsed = parse_request(input_getter(pb, request), self.config.scheduler.default_max_tokens,
                                   self.inputs.check_sampling_params, self.config.model.prompt_byte_limit)
            prompt, add_special_tokens = parsed.prompt, True
            if parsed.messages is not None:
                prompt, add_special_tokens = self.inputs.render_chat(parsed.messages), False
        except (InputError, EngineInputError) as exc:
            send_error(pb, sender, str(exc), pb.TritonError.INVALID_ARG)
            return
        prompt_token_ids = self.inputs.tokenize(prompt, add_special_tokens)  # a failure: execute() answers
        state = ResponseState(request_id, parsed.stream, parsed.exclude_input_in_output, prompt, arrival_time,
                              returns=parsed.returns, wants_logprobs=parsed.sampling_params.logprobs,
                              prompt_token_ids=prompt_token_ids, num_samples=parsed.sampling_params.n)
        pending = AddRequest(request_id, prompt_token_ids, parsed.sampling_params, arrival_time)
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
