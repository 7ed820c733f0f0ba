"""When requests are sent: closed-loop concurrency, seeded Poisson rate, or periodic bursts.

* concurrency N: N users; each sends its next request when its previous one ends (closed loop).
* rate R: open loop; gaps between sends are exponential with mean 1/R (a Poisson process),
  seeded so a run is repeatable; the first request goes at t = 0.
* burst K every T s: open loop; requests i*K .. i*K+K-1 all go at t = i*T.

Open-loop schedules are offsets in seconds from the run's start, computed up front (pure).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ArrivalPattern:
    """One point of a sweep: ``kind`` is concurrency, rate or burst."""

    kind: str
    value: float  # users, requests/s, or requests per burst
    burst_interval_s: float = 0.0  # burst only

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency={int(self.value)}"
        if self.kind == "rate":
            return f"rate={self.value:g}/s"
        return f"burst={int(self.value)}/{self.burst_interval_s:g}s"

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "value": self.value, "label": self.label}
        if self.kind == "burst":
            out["burst_interval_s"] = self.burst_interval_s
        return out


def poisson_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process with ``rate`` requests/s; the first is 0."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if num_requests <= 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def burst_offsets(num_requests: int, burst_size: int, interval_s: float) -> list[float]:
    """Send offsets (s): ``burst_size`` requests at once every ``interval_s`` seconds."""
    if burst_size <= 0 or interval_s < 0:
        raise ValueError("burst size must be > 0 and interval >= 0")
    return [(i // burst_size) * interval_s for i in range(num_requests)]


def send_offsets(pattern: ArrivalPattern, num_requests: int, seed: int) -> list[float] | None:
    """The open-loop schedule of ``pattern``; None for closed-loop concurrency."""
    if pattern.kind == "concurrency":
        return None
    if pattern.kind == "rate":
        return poisson_offsets(num_requests, pattern.value, seed)
    if pattern.kind == "burst":
        return burst_offsets(num_requests, int(pattern.value), pattern.burst_interval_s)
    raise ValueError(f"unknown arrival kind {pattern.kind!r}")


@dataclass(frozen=True, slots=True)
class Schedule:
    """A load generator's run of ``pattern``: its simulated users and when each request is due."""

    offsets: list[float] | None  # send_offsets; None: closed loop
    num_requests: int
    num_users: int

    @classmethod
    def plan(cls, pattern: ArrivalPattern, num_requests: int, seed: int, max_concurrency: int) -> Schedule:
        """Users: the closed loop's concurrency, or for an open loop up to ``max_concurrency``; never
        more than the requests, at least one."""
        offsets = send_offsets(pattern, num_requests, seed)
        wanted = int(pattern.value) if offsets is None else max_concurrency
        return cls(offsets, num_requests, max(1, min(wanted, num_requests)))

    def releases(self, start: float) -> Iterator[tuple[int | None, float]]:
        """What a dispatcher hands its users, in order, each with the time it is due (``start``:
        the run's start): every request's index (all due at once in a closed loop), then one None
        per user, the sign to stop."""
        for index in range(self.num_requests):
            yield index, start if self.offsets is None else start + self.offsets[index]
        for _ in range(self.num_users):
            yield None, start


def parse_sweep(values: str, kind: str, burst_interval_s: float = 0.0) -> list[ArrivalPattern]:
    """'1,8,32' -> one ArrivalPattern per value."""
    patterns = []
    for item in values.split(","):
        item = item.strip()
        if not item:
            continue
        value = float(item)
        if value <= 0 or (kind != "rate" and value != int(value)):
            raise ValueError(f"bad {kind} value {item!r}: expected a positive {'number' if kind == 'rate' else 'integer'}")
        patterns.append(ArrivalPattern(kind, value, burst_interval_s))
    if not patterns:
        raise ValueError(f"no {kind} values in {values!r}")
    return patterns
