"""perf.router_bench's per-request view: which first tokens no routing could have made warm."""

from __future__ import annotations

from client.bench.completed import CompletedRequest
from client.bench.stats import RequestRecord, percentile
from client.bench.workload import WorkItem
from perf.router_bench import per_request, slowest, warm_ttft_p99


def done(start: float, first: float | None, error: str | None = None) -> CompletedRequest:
    record = RequestRecord(start, (first or start) + 1.0, first, (first,) if first else (), 1 if first else 0,
                           error=error)
    return CompletedRequest(record, "length", 1, 10)


def test_a_request_is_cold_until_an_earlier_one_of_its_tenant_has_a_first_token():
    items = [WorkItem("a1", 10, 1, 0), WorkItem("b1", 10, 1, 1), WorkItem("a2", 12, 1, 0),
             WorkItem("a3", 14, 1, 0), WorkItem("b2", 12, 1, 1)]
    completed = [done(100.0, 103.0),  # tenant 0's first: cold
                 done(100.5, 101.0),  # tenant 1's first: cold
                 done(101.0, 104.5),  # tenant 0 again, sent before its first request's first token: cold
                 done(103.5, 103.7),  # sent after it: warm
                 done(100.8, None, error="boom")]  # tenant 1, sent before b1's first token: cold, failed
    keys = {id(item): f"session-{item.prompt[0]}" for item in items}
    rows = per_request(items, completed, keys)
    assert [r["cold"] for r in rows] == [True, True, True, False, True]
    assert [r["sent_s"] for r in rows] == [0.0, 0.5, 1.0, 3.5, 0.8]
    assert rows[2]["ttft_ms"] == 3500.0 and rows[2]["tenant"] == 0 and rows[2]["session"] == "session-a"
    assert rows[4]["ttft_ms"] is None and rows[4]["error"] == "boom"
    text = slowest({"requests": rows}, count=2)
    assert text == "3500 ms (cold, tenant 0, sent at 1 s), 3000 ms (cold, tenant 0, sent at 0 s)"


def test_the_warm_p99_leaves_out_the_cold_first_prefills():
    rows = [{"ttft_ms": 5000.0, "cold": True}, {"ttft_ms": None, "cold": False}]
    rows += [{"ttft_ms": float(ms), "cold": False} for ms in range(100, 200)]
    assert warm_ttft_p99({"requests": rows}) == percentile(list(range(100, 200)), 99)
    assert warm_ttft_p99({"requests": rows[:1]}) != warm_ttft_p99({"requests": rows[:1]})  # nan: no warm request
