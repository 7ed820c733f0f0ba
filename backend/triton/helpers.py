"""Triton helpers that all three models use: the locale, config.pbtxt parameters, reading inputs,
errors and the `llm` response tensors. The only place besides the model classes that knows
Triton's Python-backend conventions (pb_utils itself is passed in, never imported here).
"""

from __future__ import annotations

import json
import locale
import logging
import os
from collections.abc import Callable

import numpy as np

from backend.config import (
    GLUE_PARAMETER_NAMES,
    ConfigError,
    EngineConfig,
    parse_engine_config,
    parse_parameter_value,
)
from backend.engine_core.process_handle import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
from backend.engine_core.stub_watch import StubWatch
from backend.triton import drain

logger = logging.getLogger(__name__)

# On server stop or unload, how long requests in flight may still run: below Triton's 30 s exit timeout.
DEFAULT_SHUTDOWN_GRACE_SECONDS = 20.0


def set_utf8_locale() -> None:
    """The stub's embedded Python defaults to ASCII text encoding whatever LANG says (measured)."""
    for name in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt's ``parameters`` as {name: string value}."""
    return {name: value.get("string_value", "") for name, value in model_config.get("parameters", {}).items()}


def load_llm_config(pb, args: dict, needs_iterative_sequence: bool = False) -> tuple[str, EngineConfig, dict[str, str]]:
    """(model name, engine config, raw parameters) of an LLM model, checked.

    Raises ConfigError naming what is wrong: not decoupled, no iterative sequence batcher when one
    is needed, or a parameter (relative paths resolve against the model's folder).
    """
    model_config = json.loads(args["model_config"])
    model_name = args.get("model_name", model_config.get("name", "llm"))
    if not pb.using_decoupled_model_transaction_policy(model_config):
        raise ConfigError(f"model '{model_name}': model_transaction_policy {{ decoupled: true }} is required")
    if needs_iterative_sequence and not model_config.get("sequence_batching", {}).get("iterative_sequence", False):
        raise ConfigError(f"model '{model_name}': sequence_batching {{ iterative_sequence: true }} is required")
    parameters = model_parameters(model_config)
    # args["model_repository"] is this model's folder: relative paths resolve against it.
    config = parse_engine_config(parameters, base_dir=args["model_repository"], extra_names=GLUE_PARAMETER_NAMES)
    return model_name, config, parameters


def input_getter(pb, request) -> Callable[[str], np.ndarray | None]:
    """``get(name)``: the request's input tensor as a numpy array, None when it was not sent."""

    def get(name: str) -> np.ndarray | None:
        tensor = pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


def make_error(pb, message: str, code=None):
    if code is None:
        return pb.TritonError(message)
    try:
        return pb.TritonError(message, code)
    except TypeError:  # older stubs take no code
        return pb.TritonError(message)


def send_error(pb, sender, message: str, code=None) -> None:
    """An error response that also closes the request (FINAL)."""
    sender.send(pb.InferenceResponse(output_tensors=[], error=make_error(pb, message, code)),
                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def build_response(pb, text: str, token_ids: list[int], finish_reason: str = "",
                   num_input_tokens: int | None = None, num_output_tokens: int | None = None, extra=(),
                   requested: frozenset[str] | None = None, num_cached_tokens: int | None = None):
    """One `llm` response: text_output, output_ids, finish_reason; the token counts when given
    (``num_cached_tokens``: the prompt's tokens whose KV was found, not computed); then ``extra``. ``requested``: the outputs the client asked for (None: all); the others are
    not built (Triton would drop them before the response leaves the stub anyway)."""

    def wanted(name: str) -> bool:
        return requested is None or name in requested

    tensors = []
    if wanted("text_output"):
        tensors.append(pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)))
    if wanted("output_ids"):
        tensors.append(pb.Tensor("output_ids", np.array([token_ids], dtype=np.int32).reshape(1, -1)))
    if wanted("finish_reason"):
        tensors.append(pb.Tensor("finish_reason", np.array([[finish_reason.encode()]], dtype=np.object_)))
    if num_input_tokens is not None and wanted("num_input_tokens"):
        tensors.append(pb.Tensor("num_input_tokens", np.array([[num_input_tokens]], dtype=np.int32)))
    if num_output_tokens is not None and wanted("num_output_tokens"):
        tensors.append(pb.Tensor("num_output_tokens", np.array([[num_output_tokens]], dtype=np.int32)))
    if num_cached_tokens is not None and wanted("num_cached_tokens"):
        tensors.append(pb.Tensor("num_cached_tokens", np.array([[num_cached_tokens]], dtype=np.int32)))
    tensors.extend(extra)
    return pb.InferenceResponse(output_tensors=tensors)


def requested_outputs(request) -> frozenset[str] | None:
    """The output names a Triton request asked for; None when it named none (then all are sent)."""
    names = getattr(request, "requested_output_names", None)
    if names is None:
        return None
    asked = frozenset(names())
    return asked or None


def seconds_parameter(parameters: dict[str, str], name: str, default: float) -> float:
    """A glue parameter in seconds (finite, >= 0); ``default`` when absent or empty."""
    raw = parameters.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"parameter '{name}': expected a number of seconds, got {raw!r}") from None
    if not (value >= 0 and value < float("inf")):
        raise ConfigError(f"parameter '{name}': must be a finite number >= 0, got {raw!r}")
    return value


def positive_int_parameter(parameters: dict[str, str], name: str, default: int) -> int:
    """A glue parameter that counts something (an integer >= 1); ``default`` when absent or empty."""
    raw = parameters.get(name, "")
    return parse_parameter_value(name, "int", 1, raw) if raw.strip() else default


def bool_parameter(parameters: dict[str, str], name: str, default: bool) -> bool:
    raw = parameters.get(name, "")
    return parse_parameter_value(name, "bool", None, raw) if raw.strip() else default


def engine_process_options(parameters: dict[str, str]) -> tuple[bool, float]:
    """(run the engine core in its own process, seconds of silence after which it counts as hung)."""
    use_process = bool_parameter(parameters, "engine_process", True)
    timeout = seconds_parameter(parameters, "engine_heartbeat_timeout_seconds", DEFAULT_HEARTBEAT_TIMEOUT_SECONDS)
    if timeout < 1.0:
        raise ConfigError(f"parameter 'engine_heartbeat_timeout_seconds': must be >= 1 (the core beats every "
                          f"0.5 s), got {parameters['engine_heartbeat_timeout_seconds']!r}")
    return use_process, timeout


STUB_DEATH_ACTIONS = ("reload", "stop_server", "ignore")


def stub_watch(parameters: dict[str, str], ready_url: str | None, model_name: str = "llm"):
    """The parameter ``on_stub_death`` as the engine core's StubWatch (backend/engine_core/stub_watch.py),
    for when this model's stub dies while it serves (Triton restarts no decoupled stub): ``reload``
    (default) unloads and loads the model through Triton's model-control API, which needs
    ``--model-control-mode=explicit`` (without it: ``stop_server``, with a warning); ``stop_server``
    stops tritonserver for its supervisor to restart; ``ignore`` leaves it (its streams then hang).
    None without an HTTP readiness URL: the core could not tell a killed stub from an unload."""
    action = parameters.get("on_stub_death", "reload").strip().lower() or "reload"
    if action not in STUB_DEATH_ACTIONS:
        raise ConfigError(f"parameter 'on_stub_death': one of {', '.join(STUB_DEATH_ACTIONS)}, "
                          f"got {parameters['on_stub_death']!r}")
    if action == "ignore":
        return None
    if ready_url is None:
        logger.warning("on_stub_death: no Triton HTTP endpoint to tell a killed stub from an unload: not watched")
        return None

    argv = drain.parent_command_line()
    kill_after = drain.exit_timeout_from_command_line(argv) + 5.0
    if action == "reload":
        control_mode = (drain.tritonserver_options(argv) or {}).get("model-control-mode", "none").lower()
        http_url = parameters.get("triton_http_url", "").strip() or drain.http_url_from_command_line(argv)
        if control_mode == "explicit" and http_url:
            return StubWatch(os.getppid(), ready_url, kill_after, reload_model=model_name, http_url=http_url)
        logger.warning("on_stub_death reload: tritonserver runs with --model-control-mode=%s, which refuses "
                       "unload and load; a dead stub stops the server instead (stop_server)", control_mode)
    return StubWatch(os.getppid(), ready_url, kill_after)


def triton_readiness_url(parameters: dict[str, str], model_name: str, version: str) -> str | None:
    """Triton's HTTP readiness URL of this model version (backend/triton/drain.py): from the parameter
    ``triton_http_url``, else from tritonserver's command line; None when there is none (``none``,
    HTTP off, or a parent that is not tritonserver)."""
    url = parameters.get("triton_http_url", "").strip() or drain.http_url_from_command_line(
        drain.parent_command_line())
    if not url or url == "none":
        return None
    return drain.readiness_url(url, model_name, version)


def start_unload_watcher(ready_url: str | None, begin_drain: Callable[[], None]):
    """Calls ``begin_drain()`` once Triton reports the model unready (server stop or unload), from a
    daemon thread (backend/triton/drain.py); None when Triton's HTTP endpoint is unknown."""
    if ready_url is None:
        logger.warning("no Triton HTTP endpoint to watch: requests in flight at shutdown are not drained")
        return None
    watcher = drain.UnloadWatcher(drain.http_readiness_probe(ready_url), begin_drain)
    watcher.start()
    return watcher
