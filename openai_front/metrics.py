"""The front's own Prometheus metrics on its /metrics (Triton's, the engine's included, stay on Triton's port).

Requests by endpoint and HTTP status, their latency, the time to the first streamed piece, the
streams open now and the requests refused for being over the stream limit.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class FrontMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("openai_front_requests", "HTTP requests by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("openai_front_request_duration_seconds", "Request arrival to its last byte",
                                 ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("openai_front_time_to_first_token_seconds", "Request arrival to the first piece",
                              ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.active = Gauge("openai_front_active_generations", "Generations in flight", registry=self.registry)
        self.refused = Counter("openai_front_refused_over_limit", "Requests refused: the stream limit was reached",
                               registry=self.registry)
        self.disconnects = Counter("openai_front_client_disconnects", "Generations cancelled by a client going away",
                                   registry=self.registry)
