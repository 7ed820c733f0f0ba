"""A killed Python-backend stub brings its model back by itself (``on_stub_death: reload``).

Triton 2.51 restarts no decoupled stub and ends none of its streams. Through our launcher
(tritonserver with explicit model control), SIGKILL of the `llm` stub mid-stream: the engine core
sees its parent go and has the model unloaded and loaded again (backend/engine_core/stub_watch.py);
within 10 s the model serves the same greedy text, nothing sent after the recovery hangs,
``llm_stub_recoveries_total`` counts it, and a second crash recovers too (after its back-off).
The OpenAI front's streams on the dead stub end with a 503 the client can retry
(openai_front/orphan_watch.py); gRPC streams on it stay open until their client gives up, which
client.stream's StreamingClient now does without hanging. A kill that catches the stub holding
the shared-memory lock aborts tritonserver itself (Triton's Python backend; here at most two kills
in twenty): the launcher's restart then serves again, and the test kills a stub once more.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import httpx2 as httpx
import pytest
import tritonclient.http as httpclient

from backend.server.launcher import free_port
from backend.server.process_group import stop_process_group
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY, write_model_repository
from tests.integration.test_engine_process import stub_pids, wait_for
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

RECOVERY_LIMIT_SECONDS = 10.0
# Triton's Python backend aborts tritonserver when a stub is killed while it holds their shared
# memory's lock (a random moment, for a stub sending responses); our launcher restarts the server.
TRITON_LOCK_ABORT = "boost::interprocess::lock_exception"
MAX_ATTEMPTS = 3  # kills until one leaves tritonserver up, so that the stub's own recovery is checked
GRPC_CLIENT_TIMEOUT_SECONDS = 20.0


def front_stream(base_url: str, outcome: dict) -> None:
    """One streamed completion through the front; records its events and how it ended."""
    body = {"model": "llm", "prompt": "a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if line[6:] != "[DONE]" and "error" in json.loads(line[6:]):
                        outcome["error_at"] = time.monotonic()
    except Exception as exc:  # recorded, asserted below
        outcome["exception"] = repr(exc)
    outcome["events"] = events
    outcome["ended_at"] = time.monotonic()


def grpc_stream(grpc_url: str, model: str, outcome: dict) -> None:
    try:
        with StreamingClient(grpc_url, model) as client:
            result = client.generate("a long story", max_tokens=1900, ignore_eos=True, stream=True,
                                     timeout=GRPC_CLIENT_TIMEOUT_SECONDS)
        outcome["result"] = result
    except Exception as exc:
        outcome["exception"] = exc
    outcome["ended_at"] = time.monotonic()


def kill_and_time_recovery(repo, model: str, model_ready) -> tuple[float, int]:
    (stub,) = stub_pids(str(repo))
    os.kill(stub, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not stub_pids(str(repo)) or stub_pids(str(repo)) != [stub], 30, "the stub to go")
    time.sleep(0.3)
    wait_for(lambda: model_ready() and stub_pids(str(repo)) and stub_pids(str(repo)) != [stub], 60,
             "the model to be reloaded")
    return killed_at, stub


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_kill_9_of_the_stub_reloads_the_model_within_10_s(tmp_path, demo_model_dir, model):
    repo = write_model_repository(tmp_path / "repo", demo_model_dir, models=(model,))
    http_port, grpc_port, metrics_port, openai_port = free_port(), free_port(), free_port(), free_port()
    with_front = model == "llm"
    command = [sys.executable, "-m", "backend.server.launcher", "--model-repository", str(repo),
               "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
               *(["--openai-port", str(openai_port)] if with_front else ["--no-openai"]), "--", "--exit-timeout-secs=5"]
    launcher = subprocess.Popen(command, stdout=open(tmp_path / "launcher.log", "wb"),  # noqa: SIM115
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=str(MODEL_REPOSITORY.parent.parent))
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpc_url, front_url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{openai_port}"
    metrics = types.SimpleNamespace(metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")

    def model_ready():
        try:
            return http.is_model_ready(model)
        except Exception:
            return False

    def launcher_log() -> str:
        return (tmp_path / "launcher.log").read_text(errors="replace")

    def recoveries_reach(count: int) -> None:
        """The counter, which the new stub brings up to the recorded count as it loads, reaches
        ``count`` within 15 s; otherwise the failure names what the launcher's log says."""
        read = lambda: metric(read_metrics(metrics), "llm_stub_recoveries_total", model=model)  # noqa: E731
        deadline = time.monotonic() + 15
        while (value := read()) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        assert value == count, f"llm_stub_recoveries_total is {value}, not {count}: {server_events()}"

    def server_events() -> list[str]:
        """What the launcher's log says about the recoveries and about tritonserver's own end (a
        restart by the launcher would reset every counter)."""
        log = launcher_log().splitlines()
        marks = ("recover", "reload", "Signal", "restart", "exited", "stop_server", "SIGTERM", "tritonserver ready")
        return [line[:240] for line in log if any(mark in line for mark in marks)][-30:]

    def greedy() -> str:
        with StreamingClient(grpc_url, model) as client:
            result = client.generate("the same prompt", max_tokens=8, ignore_eos=True, stream=True, timeout=30)
        assert result.error is None, result.error
        return result.text

    def triton_aborted_since(offset: int) -> bool:
        """Whether tritonserver itself went down after log offset ``offset`` and the launcher restarted
        it. Only Triton's Python backend aborting on the dead stub's shared-memory lock is allowed
        (``terminate called after throwing an instance of 'boost::interprocess::lock_exception'``:
        a stub killed while it holds that lock, a Triton bug of every release); any other end fails."""
        log = launcher_log()[offset:]
        if "restarting it (restart" not in log and launcher.poll() is None:
            return False
        assert launcher.poll() is None and TRITON_LOCK_ABORT in log, f"tritonserver itself went down: {server_events()}"
        return True

    def join(threads: list[threading.Thread]) -> None:
        for thread in threads:
            thread.join(GRPC_CLIENT_TIMEOUT_SECONDS + 30)

    try:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            log_offset = len(launcher_log())
            wait_for(model_ready, 300, "the server")
            if with_front:
                wait_for(lambda: httpx.get(f"{front_url}/health", timeout=2).status_code == 200, 60, "the front")
            before = greedy()
            front_outcomes = [{} for _ in range(2 if with_front else 0)]
            grpc_outcome: dict = {}
            threads = [threading.Thread(target=front_stream, args=(front_url, o), daemon=True) for o in front_outcomes]
            threads.append(threading.Thread(target=grpc_stream, args=(grpc_url, model, grpc_outcome), daemon=True))
            for thread in threads:
                thread.start()
            time.sleep(3)  # every stream is decoding
            killed_at, _ = kill_and_time_recovery(repo, model, model_ready)
            back_after = time.monotonic() - killed_at
            if triton_aborted_since(log_offset):
                # The launcher's restart is the service's recovery then: it serves the same text. The
                # stub's own recovery was not exercised, so the next attempt kills a stub again.
                assert greedy() == before
                print(f"\nattempt {attempt}: tritonserver aborted on the dead stub's lock; the launcher restarted "
                      f"it and it served again {time.monotonic() - killed_at:.1f} s after the kill")
                join(threads)
                continue
            after = greedy()
            served_after = time.monotonic() - killed_at
            print(f"\n{model}: ready again {back_after:.1f} s after the kill, served again after {served_after:.1f} s")
            assert after == before
            assert served_after < RECOVERY_LIMIT_SECONDS, f"served again {served_after:.1f} s after the kill"

            # Nothing sent after the recovery hangs: a burst of streams all end with their text.
            results = []
            burst = [threading.Thread(target=lambda i=i, out=results: out.append(_short(grpc_url, model, i)), daemon=True)
                     for i in range(4)]
            for thread in burst:
                thread.start()
            join(burst)
            assert len(results) == 4 and all(r.error is None and len(r.token_ids) == 6 for r in results), results

            join(threads)
            for outcome in front_outcomes:
                assert outcome.get("status") == 200, outcome
                assert outcome["events"][-1] == "[DONE]", outcome["events"][-3:]
                error = json.loads(outcome["events"][-2])["error"]
                # model_reloaded: the stream stayed open and the orphan watch ended it; stream_lost:
                # tritonserver closed the gRPC stream itself (seen in CI: "Stream removed (Socket closed)")
                assert error["code"] in ("model_reloaded", "stream_lost") and "retry" in error["message"], error
                assert outcome["error_at"] - killed_at < RECOVERY_LIMIT_SECONDS + 3
            grpc_seen = grpc_outcome.get("exception") or grpc_outcome.get("result")
            assert "ended_at" in grpc_outcome  # the gRPC client gave up on its own timeout, without hanging
            recoveries_reach(1)  # this server's first (a restarted server counts from 0)
            front_ends = [f"{o['error_at'] - killed_at:.1f}" for o in front_outcomes]
            print(f"{model} stub killed: front streams ended with model_reloaded at {front_ends} s; "
                  f"gRPC stream: {grpc_seen!r:.120}")

            # A second crash recovers as well, after its back-off (1 s for the second within the window).
            log_offset = len(launcher_log())
            killed_at, _ = kill_and_time_recovery(repo, model, model_ready)
            assert greedy() == before
            second = time.monotonic() - killed_at
            if not triton_aborted_since(log_offset):
                assert second < RECOVERY_LIMIT_SECONDS + 2, second
                recoveries_reach(2)
            print(f"second kill: served again after {second:.1f} s")
            assert launcher.poll() is None
            break
        else:
            pytest.fail(f"tritonserver aborted on the dead stub's lock in all {MAX_ATTEMPTS} attempts: "
                        f"{server_events()}")
    finally:
        http.close()  # an open keep-alive connection holds tritonserver's stop for its exit timeout
        stop_process_group(launcher, 60)
    log = launcher_log()
    assert "reloaded in" in log, log[-3000:]
    # The server itself went down only where Triton aborted on a dead stub's lock.
    assert log.count("restarting it (restart") <= log.count(TRITON_LOCK_ABORT)


def _short(grpc_url: str, model: str, index: int):
    with StreamingClient(grpc_url, model) as client:
        return client.generate(f"after the recovery {index}", max_tokens=6, ignore_eos=True, stream=True, timeout=30)
