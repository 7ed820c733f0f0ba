"""Prometheus series read off a server's /metrics: a model's values by name, a histogram, and its
median between two readings.

The median is interpolated inside the bucket that holds it (as Prometheus' histogram_quantile
does), so it is as fine as the buckets: backend/triton/metrics.py's IPC buckets step by 50-250 us
below 1 ms.
"""

from __future__ import annotations

import re
import urllib.request

_BUCKET = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')


def model_values(metrics_url: str, names: tuple[str, ...], model: str = "llm") -> dict[str, float]:
    """{name: value} of the series ``names`` (counters, gauges, a histogram's _sum and _count) that
    carry ``model``'s label; a name the server does not report is left out."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name = line.partition("{")[0]
        if name in names and f'model="{model}"' in line:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def scrape_histogram(metrics_url: str, name: str) -> dict[float, float]:
    """{upper bound: cumulative count} of histogram ``name``, summed over its label sets."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        match = _BUCKET.match(line)
        if not match or match.group("name") != name:
            continue
        le = re.search(r'le="([^"]+)"', match.group("labels"))
        if le is None:
            continue
        bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
        buckets[bound] = buckets.get(bound, 0.0) + float(match.group("value"))
    return buckets


def histogram_median(before: dict[float, float], after: dict[float, float]) -> dict | None:
    """{"count", "median_us"} of the observations made between the two readings; None without any."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    half = counts[-1] / 2
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= half:
            if bound == float("inf"):
                return {"count": int(counts[-1]), "median_us": lower_bound * 1e6}
            share = (half - lower_count) / (count - lower_count) if count > lower_count else 0.0
            return {"count": int(counts[-1]), "median_us": (lower_bound + share * (bound - lower_bound)) * 1e6}
        lower_bound, lower_count = bound, count
    return None
