"""Seconds per phase of a step, for ``LLMEngine.step(timings=True)`` (perf/profile_step.py reads them)."""

from __future__ import annotations

import time


class PhaseClock:
    """Seconds between laps, added up by phase name."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, timings: dict[str, float], name: str) -> dict[str, float]:
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - self._last
        self._last = now
        return timings
