"""The engine core's answer to a dead stub (backend/engine_core/stub_watch.py): stop tritonserver
only while Triton still says the model serves, and SIGKILL a server that hangs on its way out."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time

import pytest

from backend.engine_core.stub_watch import StubWatch, kill_when_stuck, on_stub_death, process_gone

READY_PATH = "/v2/models/llm/versions/1/ready"


@pytest.fixture()
def triton_http():
    """A stand-in for Triton's HTTP endpoint: answers READY_PATH with ``status["code"]``."""
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == READY_PATH else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}{READY_PATH}", status
    server.shutdown()
    server.server_close()


def sleeper(ignore_sigterm: bool = False) -> subprocess.Popen:
    code = "import signal, time\n"
    if ignore_sigterm:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('up', flush=True)\ntime.sleep(60)\n"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout.readline() == b"up\n"  # its SIGTERM handler is in place
    return process


def test_a_stub_dead_while_its_model_is_ready_stops_the_server(triton_http):
    url, _ = triton_http
    server = sleeper()
    try:
        assert on_stub_death(StubWatch(server.pid, url, kill_after_seconds=5)) is True
        assert server.wait(10) == -15  # SIGTERM
    finally:
        server.kill()


@pytest.mark.parametrize("code", [400, 503])
def test_an_unloading_or_stopping_model_leaves_the_server_alone(triton_http, code):
    url, status = triton_http
    status["code"] = code  # Triton answers 400 for a model that is not ready
    server = sleeper()
    try:
        assert on_stub_death(StubWatch(server.pid, url)) is False
        time.sleep(0.3)
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_no_watch_an_unreachable_endpoint_or_a_gone_server_do_nothing(triton_http):
    url, _ = triton_http
    assert on_stub_death(None) is False
    server = sleeper()
    try:
        assert on_stub_death(StubWatch(server.pid, "http://127.0.0.1:9/v2/models/llm/ready")) is False
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()
    assert process_gone(server.pid)
    assert on_stub_death(StubWatch(server.pid, url)) is False


def test_a_server_that_ignores_sigterm_is_killed_after_the_deadline():
    server = sleeper(ignore_sigterm=True)
    started = time.monotonic()
    assert kill_when_stuck(server.pid, 0.5) == 1
    assert server.wait(5) == -9
    assert 0.5 <= time.monotonic() - started < 5


def test_a_zombie_counts_as_gone():
    server = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while not process_gone(server.pid):  # exited, not reaped yet: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert kill_when_stuck(server.pid, 5) == 0
    server.wait()


def test_crash_loop_backoff_grows_and_forgets_old_recoveries():
    from backend.engine_core.stub_watch import CRASH_LOOP_WINDOW_SECONDS, MAX_BACKOFF_SECONDS, backoff_seconds

    now = 10_000.0
    assert backoff_seconds([], now) == 0.0
    assert backoff_seconds([now - 5], now) == 1.0
    assert backoff_seconds([now - 5, now - 4, now - 3], now) == 4.0
    assert backoff_seconds([now - CRASH_LOOP_WINDOW_SECONDS - 1] * 5, now) == 0.0
    assert backoff_seconds([now - 1] * 50, now) == MAX_BACKOFF_SECONDS


def test_reload_unloads_then_loads_and_records_the_recovery(tmp_path, monkeypatch):
    """Against a stand-in for Triton's model-control API: unload, then load, in that order."""
    import tempfile

    from backend.engine_core import stub_watch

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    alive = sleeper()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert stub_watch.reload_model(url, "llm", alive.pid) == 0
        assert calls == ["/v2/repository/models/llm/unload", "/v2/repository/models/llm/load"]
        assert len(stub_watch.recorded_recoveries(alive.pid, "llm")) == 1
        assert stub_watch.recorded_recoveries(alive.pid, "other") == []
    finally:
        alive.kill()
        server.shutdown()
        server.server_close()


def test_reload_gives_up_when_the_server_is_gone(tmp_path, monkeypatch):
    import tempfile

    from backend.engine_core import stub_watch

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert stub_watch.reload_model("http://127.0.0.1:9", "llm", gone.pid) == 1


def test_a_record_left_by_an_earlier_server_with_the_same_pid_is_not_read(tmp_path, monkeypatch):
    """Pids are reused over a long run: the record names the server by pid and start time."""
    import json
    import tempfile

    from backend.engine_core import stub_watch

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    alive = sleeper()
    try:
        started = stub_watch.process_start_ticks(alive.pid)
        assert started > 0
        earlier = tmp_path / f"triton-llm-stub-recoveries-{alive.pid}-{started - 1}-llm.json"
        earlier.write_text(json.dumps([1.0, 2.0]))
        assert stub_watch.recorded_recoveries(alive.pid, "llm") == []
        (tmp_path / f"triton-llm-stub-recoveries-{alive.pid}-{started}-llm.json").write_text(json.dumps([3.0]))
        assert stub_watch.recorded_recoveries(alive.pid, "llm") == [3.0]
    finally:
        alive.kill()
