"""Which engine client a model gets (backend/engine_core/engine_client.py says what each is): a
module of its own because each implementation imports the interface, so the interface cannot
import them."""

from __future__ import annotations

from collections.abc import Callable

from backend.config import EngineConfig
from backend.engine_core.engine_client import EngineClient
from backend.engine_core.process_client import ProcessClient
from backend.engine_core.step_on_demand import InProcessTransport, ProcessTransport, StepOnDemandClient
from backend.engine_core.stub_watch import StubWatch


def make_engine_client(config: EngineConfig, *, step_on_demand: bool, in_process: bool,
                       heartbeat_timeout: float, stub_watch: StubWatch | None = None,
                       on_restart: Callable[[str], None] | None = None,
                       on_ipc: Callable[[float], None] | None = None) -> EngineClient:
    """The client a model asks for: stepping on demand or free-running, the engine in this process
    or in its own. Only ``in_process`` loads the engine (and torch) into this process."""
    max_queue_len = config.scheduler.max_queue_len
    per_client = config.scheduler.max_requests_per_client
    if step_on_demand:
        transport = (InProcessTransport(_load_engine(config)) if in_process
                     else ProcessTransport(config, heartbeat_timeout, on_restart, stub_watch))
        return StepOnDemandClient(transport, max_queue_len, per_client)
    if in_process:
        from backend.engine_core.in_thread import InThreadClient  # noqa: PLC0415 (process: torch, with the engine in this process only)

        return InThreadClient(_load_engine(config), max_queue_len, per_client)
    return ProcessClient(config, max_queue_len, heartbeat_timeout, on_restart=on_restart, on_ipc=on_ipc,
                         stub_watch=stub_watch, max_requests_per_client=per_client)


def _load_engine(config: EngineConfig):
    from backend.engine.llm_engine import LLMEngine  # noqa: PLC0415 (process: torch, with the engine in this process only)

    return LLMEngine(config)
