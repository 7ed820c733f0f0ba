"""The one in-process engine driver every benchmark uses: adds requests, steps, keeps each
request's times.

Callers own the clock and the arrivals (perf.compare: wall clock and client.bench's arrival
patterns; perf.ablations: each engine's own accumulated step time, stepping two engines in turn):
``step()`` runs one engine step, ``record(outputs, now)`` files its tokens at the caller's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.engine.outputs import RequestOutput, StepOutput
from backend.engine.request import SamplingParams


@dataclass(slots=True)
class DriverRecord:
    """One request as a client would see it (times in the caller's clock)."""

    arrival: float
    num_input_tokens: int
    arrival_cpu: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per token, at the step that made it
    token_cpu_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    end_time: float | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineDriver:
    """Feeds an LLMEngine requests keyed by any hashable (their engine id is ``f"{key}"``)."""

    def __init__(self, engine, label: str = "r"):
        self.engine = engine
        self.label = label
        self.records: dict = {}
        self.in_flight = 0
        self.steps = 0
        self.num_tokens = 0

    def add(self, key, prompt_token_ids: list[int], max_tokens: int, arrival: float,
            arrival_cpu: float | None = None) -> None:
        """Adds a request forced to exactly ``max_tokens`` outputs (ignore_eos), as benchmarks want."""
        self.engine.add_request(self._id(key), prompt_token_ids=list(prompt_token_ids),
                                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.records[key] = DriverRecord(arrival, len(prompt_token_ids), arrival_cpu)
        self.in_flight += 1

    def step(self, timings: bool = False) -> StepOutput:
        self.steps += 1
        return self.engine.step(timings)

    def record(self, outputs: list[RequestOutput], now: float, cpu_now: float | None = None) -> list:
        """Files one step's outputs at time ``now``; returns the keys that finished."""
        finished = []
        for output in outputs:
            key = self._key(output.request_id)
            record = self.records[key]
            count = len(output.new_token_ids)
            record.token_times.extend([now] * count)
            if cpu_now is not None:
                record.token_cpu_times.extend([cpu_now] * count)
            record.num_output_tokens = output.num_output_tokens
            self.num_tokens += count
            if output.finished:
                record.finish_reason = str(output.finish_reason)
                record.num_cached_tokens = output.num_cached_tokens
                record.error = output.error
                record.end_time = now
                self.in_flight -= 1
                finished.append(key)
        return finished

    def abort(self, key, reason: str = "abort (run stopped)") -> None:
        self.engine.abort_request(self._id(key))
        record = self.records[key]
        if record.finish_reason is None:
            record.finish_reason = reason
            self.in_flight -= 1

    def _id(self, key) -> str:
        return f"{self.label}-{key}"

    def _key(self, request_id: str):
        raw = request_id[len(self.label) + 1:]
        return int(raw) if raw.isdigit() else raw
