"""perf.ablations at toy size: every ablation runs and reports complete, consistent counts.

The ratios at this size are noise; only the plumbing (arrivals, token accounting, the result
structure and the JSON record) is checked.
"""

from __future__ import annotations

import json
import math

import pytest

from perf import ablations
from tests.conftest import DEMO_REPOSITORY

MODEL_FOLDER = DEMO_REPOSITORY / "llm"


def test_percentile():
    assert ablations.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert ablations.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(ablations.percentile([], 50))


@pytest.fixture(scope="module")
def smoke_record(tmp_path_factory, demo_model_dir):
    out = tmp_path_factory.mktemp("ablations") / "smoke.json"
    assert ablations.main(["--smoke", "--model-folder", str(MODEL_FOLDER), "--out-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_record_structure(smoke_record):
    assert set(smoke_record["ablations"]) == set(ablations.ABLATIONS)
    assert smoke_record["smoke"] is True
    for key in ("commit", "date", "command", "machine", "config"):
        assert key in smoke_record
    for name, result in smoke_record["ablations"].items():
        assert result["ratio"] > 0, name
        assert result["metric"] and "results" in result and "workload" in result
        if result["target"] is None:
            assert result["met"] is None
        else:
            assert result["met"] == (result["ratio"] >= result["target"])


def test_inflight_counts(smoke_record):
    result = smoke_record["ablations"]["inflight"]
    size = ablations.SIZES["smoke"]["inflight"]
    for mode in ("continuous", "static"):
        assert result["results"][mode]["num_finished"] == size["num_requests"]
        assert result["results"][mode]["output_tokens"] == result["workload"]["output_tokens"]
    # Static batching never runs more than one batch: at least as many steps as continuous.
    assert result["results"]["static"]["steps"] >= result["results"]["continuous"]["steps"]


def test_prefix_caching_counts(smoke_record):
    result = smoke_record["ablations"]["prefix_caching"]
    size = ablations.SIZES["smoke"]["prefix_caching"]
    on, off = result["results"]["caching on"], result["results"]["caching off"]
    for side in (on, off):
        assert side["num_finished"] == size["num_requests"]
        assert side["output_tokens"] == size["num_requests"] * size["output_len"]
    assert off["prefix_cache_hits"] == 0 and off["cached_tokens"] == 0
    # Every request after the first of its system prompt hits all full blocks of that prompt.
    repeats = size["num_requests"] - size["num_system_prompts"]
    full_blocks_tokens = size["system_len"] // 16 * 16
    assert on["cached_tokens"] == repeats * full_blocks_tokens
    assert 0 < result["hit_rate"] < 1


def test_chunked_prefill_counts(smoke_record):
    result = smoke_record["ablations"]["chunked_prefill"]
    size = ablations.SIZES["smoke"]["chunked_prefill"]
    num_requests = size["num_decoders"] + len(size["long_arrival_steps"])
    expected_tokens = size["num_decoders"] * size["decoder_output_len"] + len(size["long_arrival_steps"]) * size["long_output_len"]
    for side in result["results"].values():
        assert side["num_finished"] == num_requests
        assert side["output_tokens"] == expected_tokens
        assert side["num_itls"] == size["num_decoders"] * (size["decoder_output_len"] - 1)
    assert result["results"]["chunked off"]["overrides"]["enable_chunked_prefill"] == "false"


def test_paged_kv_counts(smoke_record):
    result = smoke_record["ablations"]["paged_kv"]
    size = ablations.SIZES["smoke"]["paged_kv"]
    stats = result["results"]
    # The run stops once the queue is drained (concurrency only falls after that).
    assert stats["num_finished"] + stats["num_stopped"] == size["num_requests"]
    assert stats["output_tokens"] <= result["workload"]["output_tokens"]
    assert stats["contiguous_capacity"] == size["num_blocks"] * stats["block_size"] // size["max_model_len"]
    assert 1 <= stats["paged_peak_running"] <= size["num_requests"]
    assert result["ratio"] == pytest.approx(stats["paged_peak_running"] / stats["contiguous_capacity"])
