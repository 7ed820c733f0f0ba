"""Our engine in-process, driven by the load generator's arrival logic, timed like a client would be.

No server, no IPC: requests go straight into ``LLMEngine.add_request`` and the caller steps the
engine. Arrivals follow the same ``ArrivalPattern`` as client.bench: closed-loop concurrency N keeps
N requests in the engine (the next one is added when one finishes), open-loop rate/burst patterns
add each request once its send offset has passed (sleeping only when the engine is idle). Each
request's times (added, every step that gave it tokens, finished) are taken with
``time.monotonic()`` right after the step, so TTFT, ITL, TPOT and E2E mean what they mean for a
streaming client, minus the transport. This is the ceiling the Triton path is measured against.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from backend.models.cpu_fused import fused_ops_enabled
from client.bench.arrivals import ArrivalPattern, send_offsets
from client.bench.progress import Progress
from client.bench.stats import RequestRecord


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
    over the timed run, config).
    """
    from backend.config import engine_config_from_model_folder
    from backend.engine.llm_engine import LLMEngine
    from backend.engine.request import SamplingParams
    from perf.engine_driver import EngineDriver

    config = engine_config_from_model_folder(model_folder, **(overrides or {}))
    engine = LLMEngine(config)
    engine.generate([list(requests[0][0][:8])], [SamplingParams(max_tokens=2, ignore_eos=True)])  # warm-up

    offsets = send_offsets(pattern, len(requests), seed)
    limit = int(pattern.value) if offsets is None else len(requests)
    pending = deque(range(len(requests)))
    driver = EngineDriver(engine)
    with Progress(pattern.label, len(requests), progress_interval_s) as progress:
        start, cpu_start = time.monotonic(), time.process_time()
        while pending or driver.in_flight:
            now = time.monotonic()
            while pending and driver.in_flight < limit and (offsets is None or start + offsets[pending[0]] <= now):
                index = pending.popleft()
                prompt, max_tokens = requests[index]
                driver.add(index, prompt, max_tokens, arrival=now)
            if not driver.in_flight:  # open loop, engine idle: wait for the next arrival
                time.sleep(max(0.0, start + offsets[pending[0]] - time.monotonic()))
                continue
            outputs = driver.step().outputs
            tokens_before = driver.num_tokens
            for index in driver.record(outputs, time.monotonic()):
                progress.finish(failed=driver.records[index].error is not None)
            progress.add_tokens(driver.num_tokens - tokens_before)
        duration, cpu_s = time.monotonic() - start, time.process_time() - cpu_start
    records = []
    for index in range(len(requests)):
        record = driver.records[index]
        records.append(RequestRecord(record.arrival, record.end_time, record.first_token_time, tuple(record.token_times),
                                     record.num_output_tokens, record.num_input_tokens, error=record.error))
    stats = engine.stats()
    summary = {"steps": driver.steps, "preemptions": stats.num_preemptions, "cpu_s": cpu_s, "config": str(config),
               "attention_backend": engine.model_runner.attention_backend.name,
               "fused_cpu_ops": fused_ops_enabled()
               and engine.model_runner.attention_backend.name == "cpu"}
    return records, duration, summary
