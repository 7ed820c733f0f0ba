"""What `llm` and `llm_iterative` share as Triton models: one ``initialize``, one ``finalize``.

``initialize`` reads and checks config.pbtxt (backend/triton/helpers.py), makes the metrics, picks
and starts the engine client (backend/engine_core/engine_client.py: `llm` free-running, in its
own process or on a thread; `llm_iterative` stepping on demand, in its own process or in this
one), builds the front end's InputProcessor (tokenizer, checks), lets the model start what is its
own (``start_serving``) and watches for an unload (backend/triton/drain.py). With the engine in its
own process (``engine_process: true``, the default) nothing imported here loads torch: only the
``engine_process: false`` branch loads the engine into this process.
"""

from __future__ import annotations

import abc
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from backend.config import ConfigError, EngineConfig
from backend.engine.input_processor import InputProcessor
from backend.engine.tokenizer import load_tokenizer
from backend.engine_core.engine_client import EngineClient
from backend.engine_core.make_client import make_engine_client
from backend.engine_core.process_handle import CoreStartError
from backend.engine_core.stub_watch import recorded_recoveries
from backend.lora.registry import LoRAConfigError, read_registry
from backend.triton.client_priority import parse_client_priority_range
from backend.triton.helpers import (
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    bool_parameter,
    engine_process_options,
    load_llm_config,
    positive_int_parameter,
    seconds_parameter,
    set_utf8_locale,
    start_unload_watcher,
    stub_watch,
    triton_readiness_url,
)
from backend.triton.load_metrics import LoadMetrics
from backend.triton.metrics import TritonMetrics

logger = logging.getLogger(__name__)


def start_engine(engine: EngineClient, model_name: str, config: EngineConfig) -> InputProcessor:
    """Starts the engine and returns the front end's InputProcessor for it (the tokenizer loads
    meanwhile: a model's load, and its recovery after a dead stub, wait for the slower of the two).
    An engine that does not come up fails the model's load with a ConfigError naming why."""
    with ThreadPoolExecutor(1, thread_name_prefix="llm-tokenizer-load") as pool:
        tokenizer = pool.submit(load_tokenizer, config.model.tokenizer_dir)
        try:
            ready = engine.start()
        except CoreStartError as exc:
            raise ConfigError(f"model '{model_name}': {exc}") from None
        return InputProcessor(tokenizer.result(), ready.vocab_size, ready.max_model_len, config.structured_output,
                              config.kv_transfer, lora_registry(config), config.scheduler.default_max_tokens)


def lora_registry(config: EngineConfig):
    """The adapters the model serves (backend/lora/registry.py), None without enable_lora; a bad
    multi_lora.json fails the model's load naming it."""
    if not config.lora.enable_lora:
        return None

    try:
        return read_registry(config.lora.lora_adapters)
    except LoRAConfigError as exc:
        raise ConfigError(str(exc)) from None


class EngineModel(abc.ABC):
    """Triton's ``initialize``/``finalize`` of an LLM model; subclasses add ``execute`` and what
    differs: ``start_serving``, ``begin_drain`` and ``stop_serving``."""

    step_on_demand = False  # llm_iterative: Triton's sequence batcher drives the engine's steps

    def initialize(self, args: dict) -> None:
        set_utf8_locale()
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 (process: exists only inside Triton's stub)

        self.pb = pb_utils
        self.model_name, self.config, parameters = load_llm_config(
            pb_utils, args, needs_iterative_sequence=self.step_on_demand)
        grace = seconds_parameter(parameters, "shutdown_grace_seconds", DEFAULT_SHUTDOWN_GRACE_SECONDS)
        use_process, heartbeat_timeout = engine_process_options(parameters)
        self.stream_interval = positive_int_parameter(parameters, "stream_interval", 1)
        self.response_coalescing = bool_parameter(parameters, "response_coalescing", True)
        self.client_priorities = parse_client_priority_range(parameters)
        load = LoadMetrics(pb_utils, self.model_name, str(args.get("model_version", "")),
                           self.config.cache.block_size, self.config.scheduler.max_num_seqs)
        self.metrics = metrics = TritonMetrics(pb_utils, self.model_name, load)
        # The dead stub's counter lives on in tritonserver (a family is kept by name and labels), so
        # it is brought up to the recorded count (backend/engine_core/stub_watch.py), not added to.
        recoveries = len(recorded_recoveries(os.getppid(), self.model_name))
        counted = metrics.stub_recoveries.value()
        if recoveries > counted:
            metrics.stub_recoveries.increment(recoveries - counted)
            logger.warning("model '%s': stub recovery %d in this server (llm_stub_recoveries_total was %g, now %g)",
                           self.model_name, recoveries, counted, metrics.stub_recoveries.value())
        ready_url = triton_readiness_url(parameters, self.model_name, str(args.get("model_version", "")))
        engine = make_engine_client(
            self.config, step_on_demand=self.step_on_demand, in_process=not use_process,
            heartbeat_timeout=heartbeat_timeout, stub_watch=stub_watch(parameters, ready_url, self.model_name) if use_process else None,
            on_restart=lambda reason: metrics.engine_restarts.increment(1), on_ipc=metrics.core_ipc.observe)
        try:
            self.inputs = start_engine(engine, self.model_name, self.config)
        except Exception:
            engine.stop(timeout=10.0, message="the model failed to load")  # no core outlives a failed load
            raise
        self.engine = engine
        self.start_serving()
        self.unload_watcher = start_unload_watcher(ready_url, lambda: self.begin_drain(grace))

    @abc.abstractmethod
    def start_serving(self) -> None:
        """The model's own threads, once the engine is up (``self.engine``, ``self.inputs``)."""

    @abc.abstractmethod
    def begin_drain(self, grace_seconds: float) -> None:
        """From the unload watcher's thread: Triton is unloading the model (backend/triton/drain.py)."""

    @abc.abstractmethod
    def execute(self, requests):
        """Triton's execute(): returns None (decoupled: every response goes through its sender)."""

    @abc.abstractmethod
    def stop_serving(self) -> None:
        """Unload: every request still live gets an error and its FINAL flag; the engine stops."""

    def finalize(self) -> None:
        """Requests still live get an error and their FINAL flag, so no client hangs."""
        watcher = getattr(self, "unload_watcher", None)
        if watcher is not None:
            watcher.stop()
        if getattr(self, "engine", None) is not None:
            self.stop_serving()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
