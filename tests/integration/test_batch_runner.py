"""python -m client.batch against a real tritonserver (demo model): 50 lines with some malformed, a run
killed midway and resumed (every key exactly once), the OpenAI batch output format, --validate-json
and --order input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from backend.paths import REPO_ROOT
from client.batch.runner import BatchRunner, validate_json
from client.stream import StreamingClient

pytestmark = pytest.mark.integration

WORDS = ("the", "server", "streams", "tokens", "cache", "block", "prefix", "data", "and", "batch")
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["size", "count"], "additionalProperties": False}
# (line text, the error code it must get); every other line succeeds.
BAD_LINES = [
    ("{not json", "invalid_line"),
    (json.dumps({"body": {"prompt": "no id"}}), "invalid_line"),
    (json.dumps({"custom_id": "no-prompt", "url": "/v1/completions", "body": {"max_tokens": 3}}), "invalid_request"),
    (json.dumps({"custom_id": "n-2", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}}), "invalid_request"),
    (json.dumps({"custom_id": "unknown-key", "url": "/v1/completions", "body": {"prompt": "x", "tools": []}}),
     "invalid_request"),
    (json.dumps({"custom_id": "embeddings", "url": "/v1/embeddings", "body": {"input": "x"}}), "invalid_request"),
    (json.dumps({"custom_id": "bad-temperature", "url": "/v1/completions",
                 "body": {"prompt": "x", "temperature": -1}}), "request_rejected"),
    (json.dumps({"custom_id": "no-chat-template", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "hi"}]}}), "request_rejected"),
    (json.dumps({"custom_id": "good-0", "url": "/v1/completions", "body": {"prompt": "dup"}}), "duplicate_custom_id"),
]


def good_line(index: int, max_tokens: int = 8) -> str:
    prompt = " ".join(WORDS[(index * 7 + k) % len(WORDS)] for k in range(3 + index % 5))
    return json.dumps({"custom_id": f"good-{index}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "llm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}})


def write_input(path, num_good: int, max_tokens: int = 8) -> list[str]:
    lines = [good_line(i, max_tokens) for i in range(num_good)]
    for offset, (text, _) in enumerate(BAD_LINES):  # spread among the good ones
        lines.insert(3 + offset * 4, text)
    lines.insert(10, "")  # a blank line is not a request
    path.write_text("\n".join(lines) + "\n")
    return lines


def read_output(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keys(lines: list[dict]) -> list[str]:
    return [f"line {line['line']}" if "line" in line else line["custom_id"] for line in lines]


def test_fifty_lines_with_some_malformed(triton_server, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, num_good=41)
    summary = BatchRunner(triton_server.grpc_url, concurrency=8, progress_interval=0).run(source, out)
    lines = read_output(out)
    assert summary.input_lines == 50 and len(lines) == 50 and len(set(keys(lines))) == 50
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"] and "line" not in line}
    for index in range(41):
        line = by_id[f"good-{index}"]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "text_completion" and body["model"] == "llm"
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["index"] == 0
        assert body["usage"]["completion_tokens"] == 8
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    codes = sorted(line["error"]["code"] for line in lines if line["error"] is not None)
    assert codes == sorted(code for _, code in BAD_LINES)
    assert summary.succeeded == 41 and summary.failed == 9 and summary.errors["invalid_request"] == 4
    assert summary.completion_tokens == 41 * 8
    rejected = by_id["bad-temperature"]
    assert rejected["response"] is None and "temperature" in rejected["error"]["message"]
    # The text is what the server streams for that prompt alone (greedy).
    with StreamingClient(triton_server.grpc_url) as client:
        alone = client.generate(json.loads(good_line(5))["body"]["prompt"], max_tokens=8, ignore_eos=True)
    assert by_id["good-5"]["response"]["body"]["choices"][0]["text"] == alone.text
    # A rerun finds everything done and sends nothing.
    again = BatchRunner(triton_server.grpc_url, concurrency=8, progress_interval=0).run(source, out)
    assert again.sent == 0 and again.already_done == 50 and len(read_output(out)) == 50


def test_a_run_killed_midway_resumes_with_every_key_exactly_once(triton_server, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, num_good=41, max_tokens=40)
    command = [sys.executable, "-m", "client.batch", str(source), str(out), "--url", triton_server.grpc_url,
               "--concurrency", "2", "--progress-interval", "1"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 20):
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    partial = read_output(out)
    assert 20 <= len(partial) < 50, len(partial)
    with open(out, "a") as handle:
        handle.write('{"id": "batch_req_half-writ')  # as if killed in the middle of a write
    summary = BatchRunner(triton_server.grpc_url, concurrency=4, progress_interval=0).run(source, out)
    lines = read_output(out)
    assert len(lines) == 50 and sorted(keys(lines)) == sorted(set(keys(lines)))
    assert summary.already_done == len(partial) and summary.sent == 50 - len(partial) - summary.errors["invalid_line"] \
        - summary.errors["invalid_request"] - summary.errors["duplicate_custom_id"]
    assert sum(line["error"] is None for line in lines) == 41


def test_validate_json_and_input_order(triton_server, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = []
    for index in range(6):
        body = {"prompt": f"order {index}:", "max_tokens": 40}
        if index % 3 == 0:  # plain text: not JSON
            pass
        elif index % 3 == 1:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
            body["structured_outputs"] = None
            body["guided_json"] = None
        else:
            body["structured_outputs"] = {"json": SCHEMA, "disable_any_whitespace": True}
        lines.append(json.dumps({"custom_id": f"r{index}", "url": "/v1/completions", "body": body}))
    source.write_text("\n".join(lines) + "\n")
    summary = BatchRunner(triton_server.grpc_url, concurrency=3, checks=[validate_json], progress_interval=0).run(
        source, out, order="input")
    result = read_output(out)
    assert [line["custom_id"] for line in result] == [f"r{i}" for i in range(6)]
    for index, line in enumerate(result):
        if index % 3 == 0:
            assert line["error"]["code"] == "invalid_json_output" and line["response"]["status_code"] == 200
        elif index % 3 == 2:
            assert line["error"] is None
            assert set(json.loads(line["response"]["body"]["choices"][0]["text"])) == {"size", "count"}
        else:  # any whitespace allowed: a random model may not finish the JSON within 40 tokens
            assert line["error"] is None or line["error"]["code"] == "invalid_json_output"
    assert summary.errors["invalid_json_output"] >= 2
