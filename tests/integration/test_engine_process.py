"""The engine core in its own process, through a real tritonserver (issue 14).

Greedy text of 32 concurrent mixed streams equals the engine in-process with ``engine_process``
true and false; kill -9 of the core mid-stream (`llm`, and `llm_iterative`'s step-on-demand core)
ends every stream with one error final within 10 s, the restart counter says 1 and the next
request is served (issue 20's engine-crash scenario, marker `reliability` too); unload, reload and
server stop leave no core process. (Cancellation bringing KV usage back to its baseline runs on the default, core
process, configuration in test_reliability_load.py's cancel storm.)
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import tritonclient.http as httpclient

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.proc_stat import read_proc_stat
from backend.protocol.sampling import SamplingParams
from backend.server.process_group import live_processes_in_group
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY
from tests.integration.processes import describe_processes, processes_whose_command_has
from tests.integration.test_llm_model import metric, read_metrics
from tests.integration.test_reliability import run_streams

pytestmark = pytest.mark.integration

CORE_MODULE = b"backend.engine_core.core_process"


def pids_running(server, module: bytes) -> list[int]:
    """Processes of ``module`` in the server's process group (they inherit it from the stub)."""
    return processes_whose_command_has(module, among=live_processes_in_group(server.process.pid))


def core_pids(server) -> list[int]:
    """Engine-core processes in the server's process group."""
    return pids_running(server, CORE_MODULE)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def mixed_jobs(count: int, seed: int = 14) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = "the a model server token batch stream cache block prefix engine core text".split()
    return [(" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))), rng.randint(1, 48))
            for _ in range(count)]


def streamed(jobs: list[tuple[str, int]]) -> list[tuple[str, dict]]:
    """run_streams jobs: each prompt streamed with its forced output length."""
    return [(prompt, {"max_tokens": n, "ignore_eos": True, "stream": True}) for prompt, n in jobs]


def kill_core_mid_stream(server, model: str, num_streams: int) -> tuple[list, float, int]:
    """Starts ``num_streams`` long streams, SIGKILLs the core once every one is decoding, and waits
    for the streams to end; returns (their results, when the core was killed, the killed pid)."""
    (core,) = core_pids(server)
    results: list = []
    jobs = streamed([(f"stream {i}", 1900) for i in range(num_streams)])
    thread = threading.Thread(target=lambda: results.extend(
        run_streams(server.grpc_url, jobs, timeout=60, model=model)), daemon=True)
    thread.start()

    def all_streaming():  # every stream is decoding: each step gives each one a token
        values = read_metrics(server)
        return (metric(values, "llm_num_requests_running", model=model) == num_streams
                and metric(values, "llm_generation_tokens_total", model=model) >= num_streams * 8)

    wait_for(all_streaming, 60, "every stream to produce tokens")
    os.kill(core, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(60)
    assert len(results) == num_streams
    return results, killed_at, core


@pytest.fixture(scope="module")
def offline_engine(demo_model_dir):
    return LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / "llm")))


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_32_mixed_streams_through_triton_equal_the_engine_in_process(make_server, offline_engine, engine_process):
    server = make_server({"engine_process": engine_process})
    assert len(core_pids(server)) == (1 if engine_process == "true" else 0)
    jobs = mixed_jobs(32)
    expected = offline_engine.generate([p for p, _ in jobs], [SamplingParams(max_tokens=n, ignore_eos=True)
                                                              for _, n in jobs])
    results = run_streams(server.grpc_url, streamed(jobs), timeout=180)
    for (prompt, max_tokens), result, want in zip(jobs, results, expected, strict=True):
        assert not isinstance(result, Exception), result
        assert result.error is None and result.num_final == 1
        assert result.text == want.text, prompt
        assert len(result.token_ids) == max_tokens
    values = read_metrics(server)  # exact counters: every streamed token counted once, TTFT once each
    assert metric(values, "llm_generation_tokens_total") == sum(n for _, n in jobs)
    assert metric(values, "llm_time_to_first_token_seconds_count") == len(jobs)


@pytest.mark.reliability
def test_kill_9_of_the_core_mid_stream_costs_errors_not_the_server(make_server):
    server = make_server({"engine_heartbeat_timeout_seconds": "5"})
    results, killed_at, old_core = kill_core_mid_stream(server, "llm", 8)
    for result in results:
        assert not isinstance(result, Exception), result
        assert result.num_final == 1 and result.error is not None
        assert "engine core process died" in result.error and "SIGKILL" in result.error
        assert result.end_time - killed_at < 10
        assert 0 < len(result.token_ids) < 1900  # they were mid-stream
    # the front end fails the streams first and counts the restart right after: the counter may lag
    wait_for(lambda: metric(read_metrics(server), "llm_engine_restarts_total") >= 1, 10, "the restart counter")
    assert metric(read_metrics(server), "llm_engine_restarts_total") == 1

    def served():
        with StreamingClient(server.grpc_url) as client:
            result = client.generate("after the crash", max_tokens=4, ignore_eos=True, timeout=30)
        return result if result.error is None else None  # busy while the new core loads

    result = wait_for(served, 60, "a request served by the new core")
    assert len(result.token_ids) == 4
    (new_core,) = core_pids(server)
    assert new_core != old_core and server.process.poll() is None


@pytest.mark.reliability
def test_kill_9_of_the_llm_iterative_core_ends_its_sequences_and_the_next_is_served(make_server):
    model = "llm_iterative"
    server = make_server({"engine_heartbeat_timeout_seconds": "5"}, models=(model,))
    results, killed_at, old_core = kill_core_mid_stream(server, model, 4)
    for result in results:
        assert not isinstance(result, Exception), result
        assert result.num_final == 1 and "engine core process died" in (result.error or "")
        assert result.end_time - killed_at < 10 and len(result.token_ids) > 0
    assert metric(read_metrics(server), "llm_engine_restarts_total", model=model) == 1
    with StreamingClient(server.grpc_url, model) as client:  # its iteration starts the new core first
        result = client.generate("after the crash", max_tokens=4, ignore_eos=True, stream=True, timeout=60)
    assert result.error is None and len(result.token_ids) == 4
    (new_core,) = core_pids(server)
    assert new_core != old_core and server.process.poll() is None


def test_unload_reload_and_stop_leave_no_core_process(make_server):
    server = make_server(extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    http = httpclient.InferenceServerClient(server.http_url)
    (first,) = core_pids(server)
    http.unload_model("llm")
    wait_for(lambda: not core_pids(server), 60, "the core to stop on unload")
    http.load_model("llm")
    assert http.is_model_ready("llm")
    (second,) = core_pids(server)
    assert second != first
    with StreamingClient(server.grpc_url) as client:
        assert client.generate("reloaded", max_tokens=3, ignore_eos=True).error is None
    http.close()  # an open HTTP connection keeps tritonserver's stop waiting its 30 s exit timeout
    server.stop()
    left = live_processes_in_group(server.process.pid)
    assert not left, describe_processes(left)
    for pid in (first, second):
        stat = read_proc_stat(pid)
        assert stat is None or stat.zombie


def stub_pids(marker: str) -> list[int]:
    """Python-backend stubs whose command line mentions ``marker`` (the model repository's path)."""
    return processes_whose_command_has(b"triton_python_backend_stub", marker.encode())


@pytest.mark.reliability
def test_kill_9_of_the_stub_with_stop_server_ends_every_stream_and_the_launcher_brings_the_server_back(
        tmp_path, demo_model_dir):
    """Issue 20's stub crash with ``on_stub_death: stop_server``. Triton 2.51 never restarts a
    decoupled model's stub, and nothing but the dead stub could answer its streams, so the core
    (its child) stops tritonserver once it sees the stub gone while the model still serves
    (backend/engine_core/stub_watch.py): every stream ends with an error, the model is not ready
    meanwhile, `python -m backend.server.launcher` starts the server again and the next request
    gets the same greedy text as before. (The default, ``reload``: test_stub_recovery.py.)"""
    import subprocess
    import sys

    from backend.server.launcher import free_port
    from backend.server.process_group import stop_process_group
    from tests.integration.conftest import write_model_repository

    model = "llm"
    repo = write_model_repository(tmp_path / "repo", demo_model_dir, {"on_stub_death": "stop_server"}, models=(model,))
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "backend.server.launcher", "--model-repository", str(repo), "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--no-openai", "--",
         "--exit-timeout-secs=5"],
        stdout=open(tmp_path / "launcher.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True, cwd=str(MODEL_REPOSITORY.parent.parent))
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpc_url = f"127.0.0.1:{grpc_port}"

    def model_ready():
        try:
            return http.is_model_ready(model)
        except Exception:
            return False

    try:
        wait_for(model_ready, 300, "the first server")
        with StreamingClient(grpc_url, model) as client:
            before = client.generate("the same prompt", max_tokens=8, ignore_eos=True, stream=True, timeout=60)
        assert before.error is None
        (stub,) = stub_pids(str(repo))
        results: list = []
        jobs = streamed([(f"stream {i}", 1900) for i in range(4)])
        thread = threading.Thread(target=lambda: results.extend(run_streams(grpc_url, jobs, timeout=120, model=model)),
                                  daemon=True)
        thread.start()
        time.sleep(3)  # every stream is decoding
        os.kill(stub, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: not model_ready(), 30, "the model to be reported not ready")
        unready_after = time.monotonic() - killed_at
        thread.join(120)
        assert len(results) == 4
        for result in results:
            assert not isinstance(result, Exception), result
            assert result.num_final == 1 and result.error is not None
            assert 0 < len(result.token_ids) < 1900
        ended_after = max(r.end_time for r in results) - killed_at
        wait_for(model_ready, 300, "the restarted server")
        back_after = time.monotonic() - killed_at
        (new_stub,) = stub_pids(str(repo))
        assert new_stub != stub
        with StreamingClient(grpc_url, model) as client:
            after = client.generate("the same prompt", max_tokens=8, ignore_eos=True, stream=True, timeout=60)
        assert after.error is None and after.text == before.text
        print(f"\n{model} stub killed: model unready after {unready_after:.1f} s, every stream ended by {ended_after:.1f} s "
              f"(errors like {results[0].error[:80]!r}), served again after {back_after:.1f} s")
        assert launcher.poll() is None
    finally:
        http.close()  # an open keep-alive connection holds tritonserver's stop for its exit timeout
        stop_process_group(launcher, 60)
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    assert "restarting it (restart 1" in log, log[-3000:]
    assert launcher.returncode == 0, log[-3000:]
    assert not stub_pids(str(repo))
