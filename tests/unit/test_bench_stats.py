"""client.bench statistics on synthetic records of known timings, plus the workload it measures.

Timings are binary fractions (0.5, 0.25...) so sums and means are exact; percentiles are
worked out by hand with linear interpolation (numpy.percentile's default), as vLLM reports them (compared to 1e-9 ms:
interpolation rounds in the last bit).
"""

from __future__ import annotations

import numpy as np
import pytest

from client.bench.arrivals import ArrivalPattern, burst_offsets, parse_sweep, poisson_offsets, send_offsets
from client.bench.lengths import parse_length
from client.bench.stats import RequestRecord, SloTargets, compute_metrics, summarize_ms


def known_records() -> list[RequestRecord]:
    return [
        # ttft 1.0, ITLs 0.5 0.5 1.0, e2e 3.0, tpot (3 - 1) / 3
        RequestRecord(0.0, 3.0, 1.0, (1.0, 1.5, 2.0, 3.0), num_output_tokens=4, num_input_tokens=10),
        # ttft 0.5, ITL 0.5, e2e 1.0, tpot 0.5
        RequestRecord(1.0, 2.0, 1.5, (1.5, 2.0), num_output_tokens=2, num_input_tokens=6),
        # one token: ttft 2.0, no ITL, no TPOT
        RequestRecord(2.0, 4.0, 4.0, (4.0,), num_output_tokens=1, num_input_tokens=0),
        # failed: counted apart, in no latency
        RequestRecord(0.5, 1.0, None, (), num_output_tokens=0, num_input_tokens=7, error="boom"),
    ]


def test_per_request_latencies():
    first, second, third, failed = known_records()
    assert first.ttft == 1.0 and first.e2e == 3.0 and first.inter_token_latencies == [0.5, 0.5, 1.0]
    assert first.tpot == pytest.approx(2.0 / 3.0, abs=1e-15)
    assert second.tpot == 0.5
    assert third.tpot is None and third.inter_token_latencies == []
    assert failed.ttft is None and not failed.succeeded


def test_counts_and_throughput_over_the_span_of_the_records():
    metrics = compute_metrics(known_records())
    assert metrics.duration_s == 4.0  # last end 4.0 - first start 0.0
    assert (metrics.num_requests, metrics.num_completed, metrics.num_errors) == (4, 3, 1)
    assert metrics.errors == {"boom": 1}
    assert metrics.total_input_tokens == 16 and metrics.total_output_tokens == 7  # successes only
    assert metrics.request_throughput == 0.75
    assert metrics.output_token_throughput == 1.75
    assert metrics.total_token_throughput == 5.75
    assert metrics.goodput is None and metrics.num_good is None  # no SLO given


def test_explicit_duration_wins():
    metrics = compute_metrics(known_records(), duration_s=8.0)
    assert metrics.request_throughput == 0.375 and metrics.output_token_throughput == 0.875


def test_ttft_summary_in_ms_with_interpolated_percentiles():
    ttft = compute_metrics(known_records()).ttft_ms  # samples 1000, 500, 2000 ms
    assert ttft.count == 3
    assert ttft.mean == pytest.approx(3500 / 3, abs=1e-9)
    assert ttft.percentiles == pytest.approx({"p50": 1000.0, "p90": 1800.0, "p99": 1980.0}, abs=1e-9)  # 1000 + 0.8/0.98 * 1000


def test_itl_pools_gaps_over_requests():
    itl = compute_metrics(known_records()).itl_ms  # 500, 500, 1000 (first) + 500 (second)
    assert itl.count == 4
    assert itl.mean == 625.0
    assert itl.percentiles == pytest.approx({"p50": 500.0, "p90": 850.0, "p99": 985.0}, abs=1e-9)
    assert itl.std == pytest.approx(np.std([500, 500, 1000, 500]), abs=1e-12)


def test_tpot_only_for_requests_with_more_than_one_token():
    tpot = compute_metrics(known_records()).tpot_ms  # 666.67 and 500
    assert tpot.count == 2
    assert tpot.percentiles["p50"] == pytest.approx((2000 / 3 + 500) / 2, abs=1e-9)
    assert tpot.mean == pytest.approx((2000 / 3 + 500) / 2, abs=1e-9)


def test_e2e_summary():
    e2e = compute_metrics(known_records()).e2e_ms  # 3000, 1000, 2000
    assert e2e.percentiles == pytest.approx({"p50": 2000.0, "p90": 2800.0, "p99": 2980.0}, abs=1e-9)
    assert e2e.mean == 2000.0


@pytest.mark.parametrize(
    ("slo", "num_good"),
    [
        (SloTargets(ttft_s=1.0, tpot_s=0.6), 1),  # first misses TPOT, third misses TTFT
        (SloTargets(ttft_s=2.0), 3),  # targets are inclusive
        (SloTargets(tpot_s=0.6), 2),  # a one-token request has TPOT 0 (vLLM)
        (SloTargets(ttft_s=0.25), 0),
    ],
)
def test_goodput_counts_successes_meeting_every_slo(slo, num_good):
    metrics = compute_metrics(known_records(), slo=slo)
    assert metrics.num_good == num_good
    assert metrics.goodput == num_good / 4.0


def test_custom_percentiles_and_empty_samples():
    summary = summarize_ms([0.001, 0.002, 0.003, 0.004], percentiles=(25, 75))
    assert summary.percentiles == {"p25": pytest.approx(1.75), "p75": pytest.approx(3.25)}
    empty = summarize_ms([])
    assert empty.count == 0 and empty.mean is None and empty.percentiles == {"p50": None, "p90": None, "p99": None}
    nothing = compute_metrics([])
    assert nothing.request_throughput == 0.0 and nothing.ttft_ms.count == 0


def test_all_failed_run_has_no_latencies():
    metrics = compute_metrics([known_records()[3]], slo=SloTargets(ttft_s=10))
    assert metrics.num_completed == 0 and metrics.num_good == 0 and metrics.goodput == 0.0
    assert metrics.e2e_ms.mean is None
    assert metrics.to_dict()["ttft_ms"]["p50"] is None


# ---------------------------------------------------------------- arrivals and lengths


def test_burst_offsets():
    assert burst_offsets(7, 3, 2.0) == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0]


def test_poisson_offsets_are_seeded_and_have_the_right_rate():
    offsets = poisson_offsets(20_001, rate=4.0, seed=7)
    assert offsets == poisson_offsets(20_001, rate=4.0, seed=7)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] / 20_000 == pytest.approx(0.25, rel=0.03)
    assert poisson_offsets(5, 4.0, seed=8) != poisson_offsets(5, 4.0, seed=7)


def test_sweeps_and_schedules():
    assert [p.label for p in parse_sweep("1,8,32", "concurrency")] == ["concurrency=1", "concurrency=8", "concurrency=32"]
    assert send_offsets(ArrivalPattern("concurrency", 8), 10, 0) is None
    assert send_offsets(ArrivalPattern("burst", 2, 0.5), 4, 0) == [0.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError):
        parse_sweep("1.5", "concurrency")


def test_length_specs():
    rng = np.random.default_rng(0)
    assert parse_length("16").sample(rng, 3) == [16, 16, 16]
    assert set(parse_length("uniform:3:5").sample(rng, 200)) == {3, 4, 5}
    chat = parse_length("chat:128").sample(rng, 5000)
    assert min(chat) >= 8 and max(chat) <= 1024 and np.median(chat) == pytest.approx(128, rel=0.1)
    assert max(chat) > 4 * 128  # long tail
    clipped = parse_length("lognormal:100:2.0:10:50").sample(rng, 500)
    assert min(clipped) >= 10 and max(clipped) <= 50
    for bad in ("0", "uniform:5:3", "gauss:3", "lognormal:1:2"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_prompts_have_exact_token_counts(demo_model_dir):
    from client.bench.prompts import PromptBuilder
    from client.bench.workload import SharedPrefix, build_workload

    builder = PromptBuilder(demo_model_dir)
    rng = np.random.default_rng(0)
    for length in (2, 3, 17, 64, 300):
        assert builder.count(builder.prompt(length, rng)) == length
    items = build_workload(builder, 12, parse_length("uniform:5:40"), parse_length("8"), seed=3,
                           shared_prefix=SharedPrefix(num_prefixes=2, prefix_len=33))
    assert {item.prefix_index for item in items} == {0, 1}
    for item in items:
        ids = builder.tokenizer.encode(item.prompt, add_special_tokens=True).ids
        assert len(ids) == item.num_input_tokens
        same_prefix = next(o for o in items if o.prefix_index == item.prefix_index)
        assert ids[:33] == builder.tokenizer.encode(same_prefix.prompt, add_special_tokens=True).ids[:33]
    again = build_workload(builder, 12, parse_length("uniform:5:40"), parse_length("8"), seed=3,
                           shared_prefix=SharedPrefix(num_prefixes=2, prefix_len=33))
    assert again == items
    clipped = build_workload(builder, 4, parse_length("100"), parse_length("100"), seed=1, max_model_len=150)
    assert all(item.num_input_tokens + item.max_tokens <= 150 for item in clipped)
