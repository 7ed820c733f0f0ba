"""The foundation, end to end: a real tritonserver started by our launcher streams text over gRPC."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from backend.server.process_group import live_processes_in_group
from client.stream import StreamingClient
from tests.integration.processes import describe_processes

pytestmark = pytest.mark.integration


def processes_mentioning(text: str) -> list[int]:
    """pids whose command line contains ``text`` (the server's private work folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def test_llm_streams_text_with_exactly_one_final_response(triton_server, demo_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate("The quick brown fox", max_tokens=12, stream=True, ignore_eos=True)
    assert result.error is None
    assert result.num_final == 1
    assert len(result.token_ids) == 12
    assert result.num_responses >= 2  # streamed, not one response at the end
    assert result.finish_reason == "length"
    assert result.num_output_tokens == 12
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.text


def test_non_ascii_prompt_is_tokenized_in_the_server_as_outside(triton_server, demo_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = "Crème brûlée — naïve café, 東京の天気 🙂"
    expected_prompt_ids = tokenizer(prompt)["input_ids"]
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate(prompt, max_tokens=4, stream=True, exclude_input_in_output=False, ignore_eos=True)
    assert result.error is None and result.num_final == 1
    assert result.text.startswith(prompt)
    assert result.token_ids[: len(expected_prompt_ids)] == expected_prompt_ids
    assert result.num_input_tokens == len(expected_prompt_ids)
    generated = result.token_ids[len(expected_prompt_ids):]
    assert len(generated) == 4
    assert result.text == prompt + tokenizer.decode(generated, skip_special_tokens=True)


def test_stop_leaves_no_process_even_with_live_streams(make_server):
    server = make_server()
    marker = str(server.work_dir)
    assert len(processes_mentioning(marker)) >= 2  # the server and at least one stub
    client = StreamingClient(server.grpc_url)
    client.send("a long story", max_tokens=1000, stream=True, ignore_eos=True)
    time.sleep(1.0)  # the stream is live now
    stopper = threading.Thread(target=server.stop, kwargs={"timeout": 10})
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive()
    deadline = time.monotonic() + 10
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(marker) == []
    assert server.process.poll() is not None
    left = live_processes_in_group(server.process.pid)
    assert not left, describe_processes(left)
    client.close()
