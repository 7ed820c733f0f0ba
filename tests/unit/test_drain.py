"""Draining on unload or server shutdown: the watcher's trigger and the engine loop's grace period."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.engine_core.admission import BusyError
from backend.engine_core.in_thread import InThreadClient
from backend.engine_core.process_client import ProcessClient
from backend.protocol.messages import AddRequest
from backend.protocol.sampling import SamplingParams
from backend.triton.drain import (
    UnloadWatcher,
    http_readiness_probe,
    http_url_from_command_line,
    readiness_url,
)
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
    probe = http_readiness_probe(readiness_url(f"http://127.0.0.1:{server.server_port}", "llm", "1"))
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


@pytest.fixture(params=["thread", "process"])
def loop(request, engine):
    """The `llm` model's two engines: on a thread of this process, and in a process of its own."""
    if request.param == "thread":
        made = InThreadClient(engine, max_queue_len=16)
    else:
        made = ProcessClient(engine.config, max_queue_len=16)
    made.start()
    yield made
    made.stop(timeout=10)


def request(request_id: str, prompt: str, engine, **params) -> AddRequest:
    return AddRequest(request_id, engine.tokenize(prompt), SamplingParams(**params), time.monotonic())


def collect_finals(loop, request_ids: set[str], timeout: float = 60.0):
    """The final outputs of these requests, and the engine statistics that came last."""
    finals, stats = {}, None
    deadline = time.monotonic() + timeout
    while set(finals) != request_ids and time.monotonic() < deadline:
        item = loop.outbox.get(timeout=timeout)
        assert item is not None
        stats = item[1]
        for output in item[0]:
            if output.finished:
                finals[output.request_id] = output
    return finals, stats


def test_draining_refuses_new_requests_lets_short_ones_finish_and_ends_the_rest(loop, engine):
    loop.submit(request("short", "a short one", engine, max_tokens=4, ignore_eos=True))
    loop.submit(request("long", "a long one", engine, max_tokens=1900, ignore_eos=True))
    loop.flush()
    time.sleep(0.2)
    loop.begin_drain(grace_seconds=1.0)
    started = time.monotonic()
    accepted = []
    with pytest.raises(BusyError, match="shutting down"):
        loop.submit(request("late", "too late", engine, max_tokens=4), on_accept=lambda: accepted.append(True))
    assert not accepted  # a refused request is never handed to the responder
    finals, stats = collect_finals(loop, {"short", "long"})
    assert finals["short"].error is None and finals["short"].num_output_tokens == 4
    assert "shutting down" in finals["long"].error and "shutdown_grace_seconds" in finals["long"].error
    assert 0 < finals["long"].num_output_tokens < 1900
    assert 0.7 < time.monotonic() - started < 10
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
