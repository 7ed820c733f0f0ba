"""perf.compare's parts that need no peer stack: the in-process driver, the report, the repository copy, CPU meter."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.paths import REPO_ROOT
from client.bench.arrivals import ArrivalPattern
from client.bench.stats import RequestRecord, compute_metrics
from perf.compare.cpu_meter import CpuMeter
from perf.compare.report import SystemResult, markdown_report
from perf.compare.repository import repository_with_overrides
from tests.conftest import DEMO_REPOSITORY


def _max_in_flight(records: list[RequestRecord]) -> int:
    events = sorted([(r.start_time, 1) for r in records] + [(r.end_time, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end at the same instant as a start frees the slot first
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@pytest.fixture(scope="module")
def small_requests(demo_model_dir):
    return [([1] + list(range(10, 10 + n)), out) for n, out in ((12, 5), (30, 3), (7, 6), (20, 1), (9, 4))]


def test_engine_in_process_closed_loop_keeps_the_concurrency_and_counts_every_token(small_requests):
    from perf.compare.engine_in_process import run_engine_in_process

    records, duration, summary = run_engine_in_process(str(DEMO_REPOSITORY / "llm"), small_requests,
                                                       ArrivalPattern("concurrency", 2), progress_interval_s=0)
    assert len(records) == len(small_requests) and duration > 0 and summary["steps"] > 0
    for record, (prompt, max_tokens) in zip(records, small_requests, strict=True):
        assert record.error is None
        assert record.num_output_tokens == max_tokens == len(record.token_times)
        assert record.num_input_tokens == len(prompt)
        assert record.start_time < record.first_token_time <= record.end_time
        assert list(record.token_times) == sorted(record.token_times)
    assert _max_in_flight(records) == 2
    metrics = compute_metrics(records, duration)
    assert metrics.total_output_tokens == sum(n for _, n in small_requests)


def test_engine_in_process_open_loop_waits_for_each_arrival(small_requests):
    from perf.compare.engine_in_process import run_engine_in_process

    pattern = ArrivalPattern("burst", 2, burst_interval_s=0.3)  # requests 0-1 at 0 s, 2-3 at 0.3 s, 4 at 0.6 s
    records, _, _ = run_engine_in_process(str(DEMO_REPOSITORY / "llm"), small_requests, pattern,
                                          progress_interval_s=0)
    first = min(r.start_time for r in records)
    offsets = [r.start_time - first for r in records]
    assert offsets[1] < 0.2  # with request 0, not the next burst (a step may run between the two adds)
    # offsets from request 0's own start, a little after the schedule's origin (0.296 s seen in CI)
    assert offsets[2] >= 0.25 and offsets[3] >= 0.25
    assert offsets[4] >= 0.55


def _served(name: str, tokens: int, seconds: float) -> SystemResult:
    records = [RequestRecord(0.0, seconds, 0.1, (0.1, seconds), tokens, 10)]
    return SystemResult.from_metrics(name, compute_metrics(records, seconds), "concurrency=1")


def test_report_ratios_are_ours_over_theirs():
    results = [
        _served("Triton llm (gRPC streaming)", 300, 1.0),
        _served("our engine in-process", 400, 1.0),
        _served("vLLM CPU, default (OpenAI streaming)", 200, 1.0),
        _served("vLLM CPU, tuned (OpenAI streaming)", 500, 1.0),
        SystemResult.offline("transformers static batching (batch 32)", {"output_tokens": 100, "seconds": 1.0},
                             "concurrency=1"),
    ]
    results[0].server_cpu_s, results[0].client_cpu_s = 2.0, 1.0
    document = {"workload": {"num_requests": 1, "input_len": "10", "output_len": "300", "prompt_tokens": 10,
                             "output_tokens": 300, "arrival": {"label": "concurrency=1"}, "dtype": "float32",
                             "seed": 0},
                "git": {"commit": "abc", "dirty": False}, "machine": {"cpu_count": 2}}
    report = markdown_report(document, results)
    assert "engine / transformers static: **4.00x**" in report
    assert "Triton llm / transformers static: **3.00x**" in report
    assert "engine / best vLLM (vLLM CPU, tuned (OpenAI streaming)): **0.80x**" in report
    assert "Triton llm / engine in-process: **0.75x**" in report
    triton_row = next(line for line in report.splitlines() if line.startswith("| Triton llm"))
    assert "| 2.0/1.0 | 100 |" in triton_row  # CPU seconds and 300 tokens / 3 CPU s


def test_repository_copy_overrides_a_parameter_and_keeps_paths_valid(tmp_path):
    from backend.config import engine_config_from_model_folder

    destination = repository_with_overrides(REPO_ROOT / "model_repository", "llm", {"dtype": "bfloat16"}, tmp_path)
    config = engine_config_from_model_folder(str(destination / "llm"))
    original = engine_config_from_model_folder(str(REPO_ROOT / "model_repository" / "llm"))
    assert config.model.dtype == "bfloat16"
    assert config.model.model_dir == original.model.model_dir and os.path.isdir(config.model.model_dir)
    assert config.scheduler == original.scheduler
    assert (destination / "llm" / "1" / "model.py").exists()
    with pytest.raises(KeyError, match="no_such_parameter"):
        repository_with_overrides(REPO_ROOT / "model_repository", "llm", {"no_such_parameter": "1"}, tmp_path)


def test_cpu_meter_counts_a_busy_process_group_and_this_process():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"],
                            start_new_session=True)
    try:
        time.sleep(0.2)  # let the interpreter start
        meter = CpuMeter(busy.pid)
        spin_until = time.process_time() + 0.2
        while time.process_time() < spin_until:
            pass
        time.sleep(1.0)
        meter.stop()
    finally:
        busy.kill()
        busy.wait()
    assert 0.2 <= meter.client_seconds() < 1.0  # this process spun 0.2 s and then slept
    assert 0.2 <= meter.server_seconds() <= 1.5  # the busy child ran (a share of) the 1.2 s window
    by_role = meter.seconds_by_role()
    assert by_role["client"] == meter.client_seconds()
    assert sum(v for k, v in by_role.items() if k != "client") == pytest.approx(meter.server_seconds())


def test_process_roles_name_tritons_processes_by_model():
    """A Python-backend stub is named by its model instance argument, and our engine-core process
    by the stub that started it (spawned here under the real programs' names and arguments)."""
    from perf.compare.cpu_meter import process_role

    core = (f"import subprocess, time; subprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(30)', "
            "'backend.engine_core.core_process']); time.sleep(30)")
    stub = subprocess.Popen(["bash", "-c", 'exec -a /opt/backends/python/triton_python_backend_stub "$0" "$@"',
                             sys.executable, "-c", core, "/repo/llm/1/model.py", "shm_region", "1048576", "1048576",
                             "4242", "/opt/backends/python", "336", "llm_iterative_0_0", "DEFAULT"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        children = []
        while not children and time.monotonic() < deadline:
            time.sleep(0.1)
            children = Path(f"/proc/{stub.pid}/task/{stub.pid}/children").read_text().split()
        assert process_role(stub.pid) == "stub llm_iterative"
        assert process_role(int(children[0])) == "engine core llm_iterative"
        assert process_role(os.getpid()) not in ("tritonserver", "stub llm_iterative")
    finally:
        os.killpg(stub.pid, 9)
        stub.wait()


def test_medians_table_has_cpu_ms_per_token_by_process():
    from perf.compare.report import medians_report

    runs = [_served(f"Triton llm (gRPC streaming) [run {k}]", 1000, 1.0) for k in (1, 2, 3)]
    for run, core_s in zip(runs, (8.0, 9.0, 30.0), strict=True):
        run.cpu_s_by_process = {"engine core llm": core_s, "stub llm": 2.0, "tritonserver": 1.0, "client": 0.5,
                                "stub tokenizer": 0.0}
    row = next(line for line in medians_report(runs).splitlines() if line.startswith("| Triton llm"))
    assert row.endswith("| engine core llm 9.00, stub llm 2.00, tritonserver 1.00, client 0.50 |")


def test_plot_gives_every_bar_room_for_its_two_line_label(tmp_path):
    """Fifteen runs (five systems, three rounds) get a taller figure than two, so labels don't overlap."""
    pytest.importorskip("matplotlib")
    from perf.compare.report import write_plot  # noqa: PLC0415

    def height_px(count: int) -> int:
        results = [SystemResult(f"Triton llm (gRPC streaming) [run {i}]", "concurrency=64", 1000, 2.0, 64,
                                ttft_p50_ms=100.0 + i) for i in range(count)]
        path = tmp_path / f"plot{count}.png"
        assert write_plot(results, path).startswith("plot written")
        return int.from_bytes(path.read_bytes()[20:24], "big")  # PNG IHDR: width, then height

    few, many = height_px(2), height_px(15)
    assert few == 500  # the 5-inch floor at 100 dpi
    assert many >= 15 * 0.55 * 100
