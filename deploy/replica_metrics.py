"""Reads one replica's counters from its Prometheus /metrics page (Triton's metrics port).

The nginx test and benchmark tell which replica served a request, and how many prompt tokens hit
its prefix cache, by comparing these sums before and after: the routing itself is invisible to the
client, by design.
"""

from __future__ import annotations

import re
import urllib.request

SUCCESS = "llm_request_success_total"
PREFIX_HITS = "llm_prefix_cache_hits_total"
PREFIX_QUERIES = "llm_prefix_cache_queries_total"


def counter_sum(metrics_text: str, name: str) -> float:
    """Sum of every sample of ``name`` over all its label sets (0 when absent)."""
    pattern = re.compile(r"^" + re.escape(name) + r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
    return sum(float(value) for value in pattern.findall(metrics_text))


def read_counters(metrics_url: str, names: tuple[str, ...] = (SUCCESS, PREFIX_HITS, PREFIX_QUERIES),
                  timeout: float = 5.0) -> dict[str, float]:
    """The named counters of one replica (metrics_url: http://host:port/metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
        text = response.read().decode("utf-8", errors="replace")
    return {name: counter_sum(text, name) for name in names}
