"""Token-length distributions for prompts and outputs, parsed from short command-line specs.

    128                       fixed 128
    fixed:128                 the same
    uniform:64:256            uniform integer in [64, 256]
    lognormal:M:S:MIN:MAX     lognormal with median M and log-space sigma S, rounded, clipped
    chat / chat:M             long-tailed chat-like lengths: lognormal (median M, sigma 1.0), clipped
                              to [M/16, 8M] (ShareGPT-like shape; default M 128)

Samples come from a numpy Generator the caller seeds, so workloads are repeatable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    kind: str  # fixed | uniform | lognormal
    low: int  # fixed: the value; uniform/lognormal: the minimum
    high: int  # the maximum (== low for fixed)
    median: float = 0.0  # lognormal only
    sigma: float = 0.0  # lognormal only
    spec: str = ""

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        if self.kind == "fixed":
            return [self.low] * count
        if self.kind == "uniform":
            return rng.integers(self.low, self.high, size=count, endpoint=True).tolist()
        draws = rng.lognormal(mean=np.log(self.median), sigma=self.sigma, size=count)
        return np.clip(np.rint(draws), self.low, self.high).astype(int).tolist()

    def to_dict(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "min": self.low, "max": self.high,
                **({"median": self.median, "sigma": self.sigma} if self.kind == "lognormal" else {})}


def parse_length(spec: str, minimum: int = 1) -> LengthDistribution:
    """Parses a length spec (see the module docstring); every length is >= ``minimum``."""
    text = spec.strip().lower()
    parts = text.split(":")
    try:
        if len(parts) == 1 and parts[0].isdigit():
            dist = LengthDistribution("fixed", int(parts[0]), int(parts[0]), spec=spec)
        elif parts[0] == "fixed" and len(parts) == 2:
            dist = LengthDistribution("fixed", int(parts[1]), int(parts[1]), spec=spec)
        elif parts[0] == "uniform" and len(parts) == 3:
            dist = LengthDistribution("uniform", int(parts[1]), int(parts[2]), spec=spec)
        elif parts[0] == "lognormal" and len(parts) == 5:
            dist = LengthDistribution("lognormal", int(parts[3]), int(parts[4]), float(parts[1]), float(parts[2]), spec)
        elif parts[0] == "chat" and len(parts) <= 2:
            median = float(parts[1]) if len(parts) == 2 else 128.0
            dist = LengthDistribution("lognormal", max(minimum, int(median / 16)), int(median * 8), median, 1.0, spec)
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"bad length spec {spec!r}: use N, fixed:N, uniform:MIN:MAX, lognormal:MEDIAN:SIGMA:MIN:MAX or chat[:MEDIAN]"
        ) from None
    if dist.low < minimum or dist.high < dist.low or (dist.kind == "lognormal" and (dist.median <= 0 or dist.sigma < 0)):
        raise ValueError(f"bad length spec {spec!r}: need {minimum} <= min <= max, median > 0, sigma >= 0")
    return dist
