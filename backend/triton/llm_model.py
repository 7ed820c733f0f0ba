"""The `llm` model: a decoupled Python model in front of the continuous-batching engine.

execute() validates and parses each request (a bad one gets an error response naming the field,
the others go on), hands it to the engine thread and returns None at once; the response thread
streams results back. This follows vllm_backend's threads and TensorRT-LLM's tensor names.
"""

from __future__ import annotations

import itertools
import json
import locale
import logging
import time

from backend.config import ConfigError, parse_engine_config

logger = logging.getLogger(__name__)

# Parameters of config.pbtxt that belong to this glue, not to the engine.
GLUE_PARAMETERS = frozenset()


def set_utf8_locale() -> None:
    """The stub's embedded Python defaults to ASCII text encoding whatever LANG says (measured)."""
    for name in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


def model_parameters(model_config: dict) -> dict[str, str]:
    return {name: value.get("string_value", "") for name, value in model_config.get("parameters", {}).items()}


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
        model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", model_config.get("name", "llm"))
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError(f"model '{self.model_name}': model_transaction_policy {{ decoupled: true }} is required")
        # args["model_repository"] is this model's folder: relative paths resolve against it.
        self.config = parse_engine_config(
            model_parameters(model_config), base_dir=args["model_repository"], extra_names=GLUE_PARAMETERS
        )
        self.engine = LLMEngine(self.config)
        self.metrics = TritonMetrics(pb_utils, self.model_name)
        self.loop = EngineLoop(self.engine, self.config.scheduler.max_queue_len)
        self.responder = Responder(pb_utils, self.loop, self.metrics)
        self._ids = itertools.count()
        self.loop.start()
        self.responder.start()

    def execute(self, requests):
        from backend.triton.engine_loop import BusyError, PendingRequest  # noqa: PLC0415
        from backend.triton.inputs import InputError, parse_request  # noqa: PLC0415
        from backend.triton.responder import ActiveRequest  # noqa: PLC0415

        pb = self.pb
        scheduler = self.config.scheduler
        max_tokens_limit = self.config.model.max_model_len - 1
        for request in requests:
            arrival_time = time.monotonic()
            sender = request.get_response_sender()
            request_id = f"{self.model_name}-{next(self._ids)}"

            def get_input(name, _request=request):
                tensor = pb.get_input_tensor_by_name(_request, name)
                return None if tensor is None else tensor.as_numpy()

            try:
                parsed = parse_request(get_input, scheduler.default_max_tokens, max_tokens_limit)
            except InputError as exc:
                self._send_error(sender, str(exc), pb.TritonError.INVALID_ARG)
                continue
            active = ActiveRequest(
                request_id, sender, parsed.stream, parsed.exclude_input_in_output, parsed.prompt, arrival_time
            )
            self.responder.register(active)
            try:
                self.loop.submit(PendingRequest(request_id, parsed.prompt, parsed.sampling_params, arrival_time))
            except BusyError as exc:
                self.responder.unregister(request_id)
                self._send_error(sender, str(exc), pb.TritonError.UNAVAILABLE)
        return None

    def _send_error(self, sender, message: str, code) -> None:
        pb = self.pb
        try:
            error = pb.TritonError(message, code)
        except TypeError:  # older stubs take no code
            error = pb.TritonError(message)
        sender.send(pb.InferenceResponse(output_tensors=[], error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        """Stops the threads: requests in flight get an error response and their FINAL flag."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=30.0)
            self.responder.join(timeout=30.0)
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
