"""Benchmark statistics from per-request records: pure functions, no I/O, exact on known timings.

Definitions follow vLLM's ``benchmark_serving`` so numbers compare across tools:

* TTFT = first token arrival - request start.
* ITL = gaps between successive token-carrying responses of one request, pooled over requests
  (a response that carries several tokens counts as one arrival, as in vLLM).
* TPOT of one request = (e2e - TTFT) / (output tokens - 1), only for requests with > 1 output token.
* E2E = end (final response) - start.
* Goodput = successful requests meeting every given SLO (TTFT <= target, TPOT <= target; a request
  with one output token has TPOT 0 for this test, as in vLLM) per second of benchmark duration.
* Percentiles by linear interpolation (``numpy.percentile``'s default method).

Only successful requests enter latency statistics and token counts; errors are counted apart.
Times in records are seconds (any one clock); reported latencies are milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client saw of one request (seconds on one clock)."""

    start_time: float
    end_time: float
    first_token_time: float | None
    token_times: tuple[float, ...]  # arrival of each response that carried tokens, in order
    num_output_tokens: int
    num_input_tokens: int = 0
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.start_time

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (n_out - 1); None when n_out <= 1 or no token arrived."""
        if self.ttft is None or self.num_output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class Summary:
    """Mean, standard deviation and percentiles of one latency, in milliseconds (None: no samples)."""

    count: int
    mean: float | None
    std: float | None
    percentiles: dict[str, float | None]  # "p50" -> value

    def to_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "std": self.std, **self.percentiles}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), numpy's default; nan when there are no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def summarize_ms(values_s: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Summary:
    """Summary of durations given in seconds, reported in milliseconds."""
    values = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    names = [f"p{p:g}" for p in percentiles]
    if values.size == 0:
        return Summary(0, None, None, dict.fromkeys(names))
    points = np.percentile(values, list(percentiles))
    return Summary(
        count=int(values.size),
        mean=float(values.mean()),
        std=float(values.std()),
        percentiles={name: float(v) for name, v in zip(names, points, strict=True)},
    )


@dataclass(frozen=True, slots=True)
class SloTargets:
    """Service-level objectives in seconds; None means no target on that latency."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.succeeded:
            return False
        if self.ttft_s is not None and (record.ttft is None or record.ttft > self.ttft_s):
            return False
        if self.tpot_s is not None:
            tpot = record.tpot if record.tpot is not None else 0.0  # one output token: TPOT 0 (vLLM)
            if tpot > self.tpot_s:
                return False
        return True


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """Aggregates of one benchmark run (one arrival setting)."""

    num_requests: int
    num_completed: int
    num_errors: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_token_throughput: float  # output tokens of completed requests / s
    total_token_throughput: float  # (input + output) tokens of completed requests / s
    goodput: float | None  # requests meeting every SLO / s; None without SLO targets
    num_good: int | None
    ttft_ms: Summary
    itl_ms: Summary
    tpot_ms: Summary
    e2e_ms: Summary
    errors: dict[str, int] = field(default_factory=dict)  # message -> count

    def to_dict(self) -> dict:
        out = {}
        for name in self.__slots__:
            value = getattr(self, name)
            out[name] = value.to_dict() if isinstance(value, Summary) else value
        return out


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slo: SloTargets | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """Aggregates records; ``duration_s`` defaults to last end - first start over all records."""
    if duration_s is None:
        duration_s = (max(r.end_time for r in records) - min(r.start_time for r in records)) if records else 0.0
    done = [r for r in records if r.succeeded]
    errors: dict[str, int] = {}
    for record in records:
        if not record.succeeded:
            errors[record.error] = errors.get(record.error, 0) + 1
    input_tokens = sum(r.num_input_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)

    def per_second(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    slo = slo or SloTargets()
    num_good = sum(1 for r in done if slo.met_by(r)) if slo.any else None
    return BenchmarkMetrics(
        num_requests=len(records),
        num_completed=len(done),
        num_errors=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=per_second(len(done)),
        output_token_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        goodput=None if num_good is None else per_second(num_good),
        num_good=num_good,
        ttft_ms=summarize_ms((r.ttft for r in done if r.ttft is not None), percentiles),
        itl_ms=summarize_ms((gap for r in done for gap in r.inter_token_latencies), percentiles),
        tpot_ms=summarize_ms((r.tpot for r in done if r.tpot is not None), percentiles),
        e2e_ms=summarize_ms((r.e2e for r in done), percentiles),
        errors=errors,
    )
