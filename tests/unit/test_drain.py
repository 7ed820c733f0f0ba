"""Draining on unload or server shutdown: the watcher's trigger and the engine loop's grace period."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine import LLMEngine
from backend.request import SamplingParams
from backend.triton.drain import UnloadWatcher, http_readiness_probe, http_url_from_command_line
from backend.triton.engine_loop import BusyError, EngineLoop, PendingRequest
from tests.conftest import DEMO_REPOSITORY


def run_watcher(answers):
    """Feeds the watcher these readiness answers (an Exception instance is raised); returns the calls."""
    answers = iter(answers)
    unloaded = threading.Event()
    probes = itertools.count()

    def is_ready():
        next(probes)
        answer = next(answers, None)
        if answer is None:
            return True
        if isinstance(answer, Exception):
            raise answer
        return answer

    watcher = UnloadWatcher(is_ready, unloaded.set, poll_seconds=0.001)
    watcher.start()
    fired = unloaded.wait(1.0)
    watcher.stop()
    return fired


def test_watcher_fires_when_readiness_turns_false_after_true():
    assert run_watcher([True, True, False])


def test_watcher_ignores_not_ready_before_the_model_was_ever_ready():
    assert not run_watcher([False, False, False, False])  # then True for ever


def test_an_unknown_answer_or_a_failing_probe_is_no_evidence_of_an_unload():
    assert not run_watcher([True, None, RuntimeError("probe bug"), None])  # then True for ever
    assert run_watcher([True, None, False])


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        (["/opt/tritonserver/bin/tritonserver", "--model-repository=/models"], "http://127.0.0.1:8000"),
        (["tritonserver", "--http-port=9100", "--http-address=127.0.0.1"], "http://127.0.0.1:9100"),
        (["tritonserver", "--http-port", "9200", "--http-address", "0.0.0.0"], "http://127.0.0.1:9200"),
        (["tritonserver", "--http-address=10.1.2.3"], "http://10.1.2.3:8000"),
        (["tritonserver", "--allow-http=false"], None),
        (["python", "-m", "something"], None),
        ([], None),
    ],
)
def test_the_http_endpoint_comes_from_tritonservers_command_line(argv, url):
    assert http_url_from_command_line(argv) == url


def test_the_http_probe_reads_readiness_and_treats_a_vanished_endpoint_as_not_ready():
    import http.server

    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            assert self.path == "/v2/models/llm/versions/1/ready"
            self.send_response(status["code"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    probe = http_readiness_probe(f"http://127.0.0.1:{server.server_port}", "llm", "1")
    try:
        assert probe() is True
        status["code"] = 400  # what Triton answers for an unloading model
        assert probe() is False
    finally:
        server.shutdown()
        server.server_close()
    assert probe() is False  # connection refused: the server's HTTP front end is gone


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))


def collect_finals(loop: EngineLoop, request_ids: set[str], timeout: float = 60.0):
    finals = {}
    deadline = time.monotonic() + timeout
    while set(finals) != request_ids and time.monotonic() < deadline:
        item = loop.outbox.get(timeout=timeout)
        assert item is not None
        for output in item[0]:
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_draining_refuses_new_requests_lets_short_ones_finish_and_ends_the_rest(engine):
    loop = EngineLoop(engine, max_queue_len=16)
    loop.start()
    try:
        now = time.monotonic()
        loop.submit(PendingRequest("short", "a short one", SamplingParams(max_tokens=4, ignore_eos=True), now))
        loop.submit(PendingRequest("long", "a long one", SamplingParams(max_tokens=1900, ignore_eos=True), now))
        loop.begin_drain(grace_seconds=1.0)
        started = time.monotonic()
        accepted = []
        with pytest.raises(BusyError, match="shutting down"):
            loop.submit(PendingRequest("late", "too late", SamplingParams(max_tokens=4), now),
                        on_accept=lambda: accepted.append(True))
        assert not accepted  # a refused request is never handed to the responder
        finals = collect_finals(loop, {"short", "long"})
        assert finals["short"].error is None and finals["short"].num_output_tokens == 4
        assert "shutting down" in finals["long"].error and "shutdown_grace_seconds" in finals["long"].error
        assert 0 < finals["long"].num_output_tokens < 1900
        assert 0.9 < time.monotonic() - started < 10
        assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0.0
    finally:
        loop.stop(timeout=10)
