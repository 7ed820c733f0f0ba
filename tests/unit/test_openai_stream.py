"""The OpenAI-compatible streaming client and the load generator's `openai` API, against a local fake server.

The fake speaks what vLLM's /v1/completions does with ``stream: true``: server-sent events, one
chunk per token, a final chunk with ``finish_reason``, a usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from client.bench.arrivals import ArrivalPattern
from client.bench.runner import API_OPENAI, run_workload
from client.bench.workload import WorkItem
from client.openai_stream import OpenAIStreamingClient


class _FakeCompletions(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests_seen: list[dict] = []

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests_seen.append(body)
        if body["max_tokens"] <= 0:
            payload = json.dumps({"error": {"message": "max_tokens must be at least 1"}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        words = [f"w{i} " for i in range(body["max_tokens"])]
        events = [{"choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in words]
        events[-1]["choices"][0]["finish_reason"] = "length"
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                                "completion_tokens": len(words)}})
        for event in events:
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture()
def fake_server():
    _FakeCompletions.requests_seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stream_reads_text_chunk_times_and_usage(fake_server):
    seen = []
    with OpenAIStreamingClient(fake_server, "demo") as client:
        result = client.generate("a b c", max_tokens=5, on_chunk=lambda r: seen.append(len(r.deltas)))
        again = client.generate("a b", max_tokens=2)  # the keep-alive connection carries a second request
    assert result.error is None
    assert result.text == "w0 w1 w2 w3 w4 "
    assert (result.num_input_tokens, result.num_output_tokens, result.finish_reason) == (3, 5, "length")
    assert len(result.token_times) == 5 and result.token_times == sorted(result.token_times)
    assert result.start_time <= result.first_token_time == result.token_times[0] <= result.end_time
    assert seen == [1, 2, 3, 4, 5]
    assert (again.text, again.num_output_tokens) == ("w0 w1 ", 2)
    sent = _FakeCompletions.requests_seen[0]
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["temperature"] == 0.0
    assert sent["stream_options"] == {"include_usage": True} and sent["model"] == "demo"


def test_http_error_becomes_the_requests_error(fake_server):
    with OpenAIStreamingClient(fake_server, "demo") as client:
        result = client.generate("a", max_tokens=0)
    assert result.error is not None and result.error.startswith("HTTP 400") and "max_tokens" in result.error
    assert result.token_times == []


def test_load_generator_runs_an_openai_workload(fake_server):
    items = [WorkItem(prompt=" ".join(["x"] * (i + 2)), num_input_tokens=i + 2, max_tokens=3 + i) for i in range(6)]
    completed, duration = run_workload(fake_server, "demo", items, ArrivalPattern("concurrency", 3), api=API_OPENAI)
    assert duration > 0 and len(completed) == 6
    for item, done in zip(items, completed, strict=True):
        assert done.record.error is None
        assert done.record.num_output_tokens == item.max_tokens == len(done.record.token_times)
        assert done.record.num_input_tokens == item.num_input_tokens
        assert done.finish_reason == "length"


def test_unreachable_server_is_a_failed_request_not_a_crash():
    items = [WorkItem(prompt="x", num_input_tokens=1, max_tokens=2)]
    completed, _ = run_workload("http://127.0.0.1:9", "demo", items, ArrivalPattern("concurrency", 1), api=API_OPENAI)
    assert completed[0].record.error is not None and "Connection" in completed[0].record.error


class _ClosesIdleConnections(_FakeCompletions):
    """Like a proxy's keepalive timeout: the connection is closed after each response without a
    ``Connection: close`` header, so the client finds out only when it reuses it."""

    def do_POST(self) -> None:  # noqa: N802
        super().do_POST()
        self.close_connection = True


def test_a_kept_alive_connection_the_server_closed_is_replaced_once():
    _FakeCompletions.requests_seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ClosesIdleConnections)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with OpenAIStreamingClient(f"http://127.0.0.1:{server.server_address[1]}", "demo") as client:
            first = client.generate("a", max_tokens=2)
            second = client.generate("a b", max_tokens=3)  # the first connection is gone by now
        assert first.error is None and second.error is None and second.num_output_tokens == 3
        assert len(_FakeCompletions.requests_seen) == 2  # each request reached the server once
    finally:
        server.shutdown()
        server.server_close()
