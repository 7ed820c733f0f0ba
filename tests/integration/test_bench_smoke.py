"""Benchmark tooling against a real server: client.bench, perf_analyzer and genai-perf, each briefly.

Each run is a few seconds of load on the session's server, so all three fit in well under the
two-minute budget on 2 cores. perf_analyzer and genai-perf are skipped (with the reason) only when
they cannot run here and their missing pieces cannot be installed.
"""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from client.bench.cli import main as bench_main
from perf.perf_analyzer_env import ensure_perf_analyzer
from perf.run_genai_perf import find_genai_perf
from perf.run_genai_perf import main as genai_perf_main
from perf.run_perf_analyzer import main as perf_analyzer_main

pytestmark = pytest.mark.integration


def test_load_generator_reports_every_request(triton_server, demo_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    code = bench_main([
        "--url", triton_server.grpc_url, "--tokenizer", str(demo_model_dir), "--concurrency", "3",
        "--num-requests", "6", "--input-len", "uniform:8:40", "--output-len", "8", "--seed", "11",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--progress-interval", "1",
        "--out-json", str(out), "--out-md", str(tmp_path / "bench.md"), "--out-plot", str(tmp_path / "bench.png"),
    ])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["model"] == "llm" and document["git"]["commit"]
    assert document["machine"]["cpu_count"] >= 1
    assert document["server_model_config"]["parameters"]["max_model_len"]
    (run,) = document["runs"]
    metrics = run["metrics"]
    assert run["arrival"] == {"kind": "concurrency", "value": 3.0, "label": "concurrency=3"}
    assert (metrics["num_requests"], metrics["num_completed"], metrics["num_errors"]) == (6, 6, 0)
    assert metrics["total_output_tokens"] == 48 and metrics["num_good"] == 6
    assert metrics["ttft_ms"]["count"] == 6 and metrics["tpot_ms"]["count"] == 6
    assert metrics["itl_ms"]["count"] >= 6  # at least one gap per request (tokens may share a response)
    assert run["num_mismatched_lengths"] == 0
    for row in run["requests"]:
        assert row["error"] is None and row["finish_reason"] == "length"
        assert row["output_tokens"] == 8 and row["input_tokens"] == row["expected_input_tokens"]
    assert "| concurrency=3 | 6 | 0 |" in (tmp_path / "bench.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench.png").stat().st_size > 0


def test_perf_analyzer_streaming_sweep(triton_server, demo_model_dir, tmp_path):
    problem = ensure_perf_analyzer()
    if problem:
        pytest.skip(f"perf_analyzer cannot run here: {problem}")
    out_dir = tmp_path / "pa"
    code = perf_analyzer_main([
        "--url", triton_server.grpc_url, "--tokenizer", str(demo_model_dir), "--concurrency-range", "1:2:1",
        "--input-len", "24",
        "--output-len", "8", "--num-prompts", "8", "--measurement-request-count", "4",
        "--stability-percentage", "999", "--max-trials", "3", "--out-dir", str(out_dir),
    ])
    assert code == 0, (out_dir / "perf_analyzer.log").read_text()[-3000:]
    rows = list(csv.DictReader((out_dir / "perf_analyzer.csv").open()))
    assert [row["Concurrency"] for row in rows] == ["1", "2"]
    assert all(float(row["Inferences/Second"]) > 0 for row in rows)
    export = json.loads((out_dir / "profile_export.json").read_text())
    requests = [r for experiment in export["experiments"] for r in experiment["requests"]]
    # One response per token, unless steps waited for the responder and were coalesced (README
    # "Streamed responses"): never more than the 8 tokens.
    assert requests and all(1 <= len(r["response_timestamps"]) <= 8 for r in requests)
    token_metrics = json.loads((out_dir / "token_metrics.json").read_text())
    assert [row["label"] for row in token_metrics] == ["concurrency=1", "concurrency=2"]
    assert all(row["metrics"]["num_errors"] == 0 and row["metrics"]["ttft_ms"]["p50"] > 0 for row in token_metrics)


def profile_with_genai_perf(arguments: list[str], tmp_path) -> dict:
    """perf.run_genai_perf with ``arguments`` at concurrency 2, briefly; its JSON report. Skipped
    (with the reason) only when perf_analyzer or genai-perf cannot run here. One retry: in one CI
    run (2026-12-02) perf_analyzer exited 0 with an empty profile export and printed nothing, and it
    passed in the CI run before and locally after; both logs go into the failure message."""
    problem = ensure_perf_analyzer()
    if problem:
        pytest.skip(f"genai-perf drives perf_analyzer, which cannot run here: {problem}")
    if find_genai_perf() is None:
        pytest.skip("genai-perf is not installed (pip install -e '.[perf]' installs genai-perf==0.0.8)")
    logs = []
    for attempt in range(2):
        # -v: perf_analyzer's own output goes into genai_perf.log too.
        out_dir = tmp_path / f"gp{attempt}"
        code = genai_perf_main([
            *arguments, "--concurrency", "2", "--input-len", "24", "--output-len", "8",
            "--num-prompts", "8", "--out-dir", str(out_dir),
            "--", "-v", "--", "--measurement-mode", "count_windows", "--measurement-request-count", "4",
            "-s", "999", "-r", "3",
        ])
        logs.append((out_dir / "concurrency2" / "genai_perf.log").read_text())
        if code == 0:
            break
        print(f"genai-perf attempt {attempt + 1} failed:\n{logs[-1][-4000:]}")
    assert code == 0, "\n---\n".join(log[-3000:] for log in logs)
    return json.loads((out_dir / "concurrency2" / "profile_export_genai_perf.json").read_text())


def test_genai_perf_profile(triton_server, demo_model_dir, tmp_path):
    report = profile_with_genai_perf(["--url", triton_server.grpc_url, "--tokenizer", str(demo_model_dir)], tmp_path)
    assert report["request_throughput"]["avg"] > 0
    assert report["time_to_first_token"]["avg"] > 0 and report["inter_token_latency"]["avg"] > 0


def test_one_shared_stream_carries_every_threads_requests(triton_server):
    """client.stream.SharedStream (the load generator's default for Triton): eight requests from four
    threads on one gRPC stream, each answered in full with exactly the greedy tokens it gets on a
    stream of its own, one FINAL each."""
    import threading

    from client.stream import SharedStream, StreamingClient

    prompts = [f"Prompt number {i}: the quick brown fox" + " jumps" * i for i in range(8)]
    with StreamingClient(triton_server.grpc_url) as alone:
        want = [alone.generate(p, max_tokens=6, ignore_eos=True, stream=True).token_ids for p in prompts]
    shared = SharedStream(triton_server.grpc_url)
    got: dict[int, object] = {}

    def user(indices):
        for i in indices:
            got[i] = shared.generate(prompts[i], max_tokens=6, ignore_eos=True, stream=True)

    threads = [threading.Thread(target=user, args=(range(k, 8, 4),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    shared.close()
    assert sorted(got) == list(range(8))
    for i, result in got.items():
        assert result.error is None and result.num_final == 1
        assert result.token_ids == want[i] and len(result.token_ids) == 6


@pytest.mark.parametrize("kind", ["aio-stream-per-user", "http-stream-per-user"])
def test_other_client_kinds_give_the_threaded_clients_results(triton_server, kind):
    """client.bench.triton_clients' ``aio-stream-per-user`` (a coroutine and a gRPC stream per
    user) and ``http-stream-per-user`` (a thread and an HTTP generate_stream connection per user):
    ten forced-length requests from three users end with the text, token count and finish reason
    the threaded stream-per-user client gets for them; a request the model refuses (a negative
    max_tokens) is that request's error alone, and its user goes on."""
    from client.bench.arrivals import ArrivalPattern
    from client.bench.triton_clients import client_url, run_triton_workload
    from client.bench.workload import WorkItem

    items = [WorkItem(f"Prompt number {i}: the quick brown fox" + " jumps" * i, 0, 3 + i % 4) for i in range(10)]
    items[4] = WorkItem("refused", 0, -1)
    pattern = ArrivalPattern("concurrency", 3)
    threaded, _ = run_triton_workload(triton_server.grpc_url, "llm", items, pattern, "stream-per-user", timeout_s=120)
    coroutines, duration = run_triton_workload(client_url(triton_server, kind), "llm", items, pattern, kind,
                                               timeout_s=120)
    assert len(coroutines) == 10 and duration > 0
    for index, (want, got) in enumerate(zip(threaded, coroutines, strict=True)):
        if index == 4:
            assert want.record.error and "max_tokens" in got.record.error
            continue
        assert got.record.error is None and got.finish_reason == want.finish_reason == "length"
        assert got.text == want.text and got.record.num_output_tokens == want.record.num_output_tokens == 3 + index % 4
        assert got.record.first_token_time is not None
        assert got.record.start_time <= got.record.first_token_time <= got.record.end_time
        assert len(got.record.token_times) >= 1
