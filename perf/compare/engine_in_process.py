"""Our engine in-process, driven by the load generator's arrival logic, timed like a client would be.

No server, no IPC: perf/engine_driver.py adds the requests straight to ``LLMEngine.add_request``
and steps the engine. Arrivals follow the same ``ArrivalPattern`` as client.bench: closed-loop
concurrency N keeps N requests in the engine (the next one is added when one finishes), open-loop
rate/burst patterns add each request once its send offset has passed (sleeping only when the
engine is idle). Each request's times (added, every step that gave it tokens, finished) are taken with
``time.monotonic()`` right after the step, so TTFT, ITL, TPOT and E2E mean what they mean for a
streaming client, minus the transport. This is the ceiling the Triton path is measured against.
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from client.bench.arrivals import ArrivalPattern
from client.bench.progress import Progress
from client.bench.stats import RequestRecord
from perf import engine_driver


def run_engine_in_process(
    model_folder: str,
    requests: Sequence[tuple[list[int], int]],  # (prompt token ids with BOS, forced output tokens) each
    pattern: ArrivalPattern,
    overrides: dict[str, str] | None = None,
    seed: int = 0,
    progress_interval_s: float = 5.0,
) -> tuple[list[RequestRecord], float, dict]:
    """Runs ``requests`` through a fresh engine configured by ``model_folder``'s config.pbtxt.

    Returns the per-request records (input order), the wall duration (s) from the first arrival to
    the last token, and a summary of the engine (steps, preemptions, CPU seconds of this process
    over the timed run, config, and the times its CPU thread governor cut the threads).
    """
    config = engine_config_from_model_folder(model_folder, **(overrides or {}))
    engine = LLMEngine(config)
    engine_driver.warm_up(engine, requests[0][0][:8])
    if engine.structured_output is not None:  # its compile worker's first start, as the served systems wait for it
        engine.structured_output.compiler.wait_started(120)
    with Progress(pattern.label, len(requests), progress_interval_s) as progress:
        done = engine_driver.run(engine, requests, pattern, seed, progress)
    stats = engine.stats()
    backend = engine.model_runner.attention_backend.name
    summary = {"steps": done.driver.steps, "preemptions": stats.num_preemptions, "cpu_s": done.cpu_s,
               "config": str(config), "attention_backend": backend,
               "fused_cpu_ops": config.model.cpu_fused_ops and backend == "cpu",
               "cpu_thread_reductions": stats.cpu_thread_reductions}
    return [record.request_record() for record in done.records], done.duration_s, summary
