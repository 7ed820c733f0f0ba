"""The OpenAI-compatible front (openai_front) against a real tritonserver, through the official `openai` SDK.

The front runs as `make serve` runs it (its own process, `python -m openai_front`) in front of
tritonserver on the served repository (SmolLM2-135M-Instruct: the chat tests need its chat
template). Greedy answers are compared with the same request over
Triton's gRPC stream (client.stream), and usage with the token counts Triton reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import httpx2 as httpx
import jsonschema
import openai
import pytest

from backend.server.launcher import answers_200, free_port
from client.stream import StreamingClient

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


def start_front(grpc_url: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "openai_front", "--triton-url", grpc_url, "--host", "127.0.0.1",
                                "--port", str(port), *extra], start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the front exited while starting"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the front did not become healthy in 60 s")


def stop_front(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass(frozen=True)
class Served:
    front: str  # http://127.0.0.1:PORT
    grpc_url: str
    metrics_url: str


@pytest.fixture(scope="module")
def served():
    """`make serve` as it runs: the launcher starts tritonserver on the served repository and the
    front beside it; SIGINT (Ctrl-C) must stop both."""
    from backend.models.smollm2_model import build

    build()  # made by make setup; a no-op then
    http, grpc, metrics, openai_port = (free_port() for _ in range(4))
    launcher = subprocess.Popen([sys.executable, "-m", "backend.server.launcher", "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port",
                                 str(openai_port)], stdout=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{openai_port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert launcher.poll() is None, "make serve's launcher exited while starting"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the front of make serve was not healthy in 300 s")
        yield Served(base, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
    finally:
        launcher.send_signal(signal.SIGINT)
        try:
            code = launcher.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            raise
        assert code == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/health", timeout=2)  # the front stopped with it


@pytest.fixture(scope="module")
def front(served):
    return served.front


@pytest.fixture(scope="module")
def sdk(front):
    return openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=120)


def triton_metric(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and 'model="llm"' in line]
    return sum(values)


def test_the_readme_question_is_answered(sdk):
    answer = sdk.chat.completions.create(model="llm", messages=[{"role": "user",
                                                                 "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content


def test_models_health_and_tokenize(front, sdk):
    assert [m.id for m in sdk.models.list().data] == ["llm"]
    assert httpx.get(f"{front}/health").status_code == 200
    tokens = httpx.post(f"{front}/tokenize", json={"model": "llm", "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{front}/detokenize", json={"model": "llm", "tokens": tokens["tokens"]}).json()["prompt"]
    assert "hello world" in text


def test_the_render_routes_give_the_ids_the_engine_computes(front, sdk):
    """What vllm-router routes on (the render answers) is what `llm` prefills: the same count as
    its usage, and for a completion the tokenizer's own ids."""
    chat = httpx.post(f"{front}/v1/chat/completions/render", json={"model": "llm", "messages": MESSAGES},
                      timeout=60).json()
    answer = sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1, temperature=0)
    assert len(chat["token_ids"]) == answer.usage.prompt_tokens > 10
    prompt = "The capital of France is"
    [completion] = httpx.post(f"{front}/v1/completions/render", json={"model": "llm", "prompt": prompt},
                              timeout=60).json()
    tokens = httpx.post(f"{front}/tokenize", json={"model": "llm", "prompt": prompt}).json()["tokens"]
    generated = sdk.completions.create(model="llm", prompt=prompt, max_tokens=1, temperature=0)
    assert completion["token_ids"] == tokens and len(tokens) == generated.usage.prompt_tokens


def test_chat_greedy_equals_grpc_and_usage_equals_tritons_counts(sdk, served):
    answer = sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    with StreamingClient(served.grpc_url) as client:
        direct = client.generate(None, messages=MESSAGES, max_tokens=12, temperature=0.0, ignore_eos=True,
                                 stream=True)
    assert direct.error is None
    assert answer.choices[0].message.content == direct.text
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == len(direct.token_ids) == 12
    assert answer.usage.prompt_tokens == direct.num_input_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12
    assert answer.object == "chat.completion" and answer.system_fingerprint


def test_streamed_chat_and_completion_equal_the_non_streamed_ones(sdk):
    whole = sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    text = sdk.completions.create(model="llm", prompt="Once upon a time", max_tokens=10, temperature=0)
    streamed = list(sdk.completions.create(model="llm", prompt="Once upon a time", max_tokens=10, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert text.object == "text_completion" and text.usage.completion_tokens > 0


def test_n_seed_stop_echo_and_logprobs(sdk):
    sampled = {"model": "llm", "messages": MESSAGES, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7,
               "extra_body": {"ignore_eos": True}}
    two = sdk.chat.completions.create(**sampled)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 16  # both samples' tokens
    again = sdk.chat.completions.create(**sampled)
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]

    free = sdk.completions.create(model="llm", prompt="a b c", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    stop = free.choices[0].text[3:6]
    assert stop.strip(), f"no stop string to pick from {free.choices[0].text!r}"
    stopped = sdk.completions.create(model="llm", prompt="a b c", max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and free.choices[0].text.startswith(stopped.choices[0].text)

    echoed = sdk.completions.create(model="llm", prompt="a b c", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("a b c")

    chat = sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob <= token.top_logprobs[0].logprob + 1e-5  # greedy: the chosen token is the best
    completion = sdk.completions.create(model="llm", prompt="a b c", max_tokens=4, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


def test_logit_bias_that_bans_the_greedy_token_changes_it_for_that_request_only(front, sdk):
    """OpenAI's logit_bias through the SDK: -100 on the token greedy decoding picks first makes the
    first token another; the same request without it still picks it."""
    def first_token(**extra) -> str:
        return sdk.completions.create(model="llm", prompt="The capital of France is", max_tokens=1, temperature=0,
                                      **extra).choices[0].text

    greedy = first_token()
    tokens = httpx.post(f"{front}/tokenize", json={"model": "llm", "prompt": greedy, "add_special_tokens": False},
                        timeout=60).json()["tokens"]
    assert len(tokens) == 1, tokens
    banned = first_token(extra_body={"logit_bias": {str(tokens[0]): -100}})
    assert banned and banned != greedy
    assert first_token() == greedy


def test_a_repeated_long_prompt_reports_its_cached_tokens(sdk):
    """usage.prompt_tokens_details.cached_tokens: the second time a long prompt comes, its full
    blocks are prefix-cache hits, which the `llm` model reports as num_cached_tokens."""
    prompt = " ".join(f"item {i} of a long list that repeats;" for i in range(60))
    first = sdk.completions.create(model="llm", prompt=prompt, max_tokens=2, temperature=0)
    second = sdk.completions.create(model="llm", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 256
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached >= second.usage.prompt_tokens - 64
    assert first.usage.prompt_tokens_details.cached_tokens < cached


def test_a_token_id_prompt_generates_what_its_text_does(front, sdk):
    """prompt as token ids (the `llm` model's input_ids): the same greedy text as the text prompt,
    a list of such lists is one choice each, and an id outside the vocabulary is a 400 naming prompt."""
    text = "The capital of France is"
    ids = httpx.post(f"{front}/tokenize", json={"model": "llm", "prompt": text}, timeout=60).json()["tokens"]
    by_text = sdk.completions.create(model="llm", prompt=text, max_tokens=8, temperature=0)
    by_ids = sdk.completions.create(model="llm", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    two = sdk.completions.create(model="llm", prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert sorted(choice.index for choice in two.choices) == [0, 1]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model="llm", prompt=[99999999], max_tokens=2)
    assert refused.value.body["param"] == "prompt" and "input_ids" in refused.value.body["message"]


@pytest.fixture(scope="module")
def thinking_sdk(served):
    """A second front on the same tritonserver, run as a reasoning model's would be (--reasoning-parser qwen3)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "openai_front", "--triton-url", served.grpc_url, "--port",
                                str(port), "--reasoning-parser", "qwen3"], stdout=subprocess.DEVNULL,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not answers_200(f"{base}/health"):
            assert process.poll() is None and time.monotonic() < deadline, "the second front did not start"
            time.sleep(0.2)
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


THINKING = r"<think>[a-z ]{3,30}</think>[A-Z][a-z]{2,12}\."  # a <think> section any model can be made to write


def test_a_reasoning_parser_splits_a_think_section_from_the_content_whole_and_streamed(thinking_sdk):
    import re

    request = {"model": "llm", "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
               "extra_body": {"structured_outputs": {"regex": THINKING}}}
    message = thinking_sdk.chat.completions.create(**request).choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert re.fullmatch(r"[a-z ]{3,30}", reasoning) and message.model_extra["reasoning_content"] == reasoning
    assert re.fullmatch(r"[A-Z][a-z]{2,12}\.", message.content)
    streamed_reasoning = streamed_content = ""
    for chunk in thinking_sdk.chat.completions.create(stream=True, **request):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning") or ""
            streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
    hidden = thinking_sdk.chat.completions.create(**{**request, "extra_body": {
        "structured_outputs": {"regex": THINKING}, "include_reasoning": False}}).choices[0].message
    assert hidden.content == message.content and "reasoning" not in (hidden.model_extra or {})


def test_json_schema_response_format_parses_and_validates(sdk):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = sdk.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(answer.choices[0].message.content)
    jsonschema.validate(value, schema)


BAD_REQUESTS = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),  # the front's check
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),  # the `llm` model's: not in the vocabulary
    ({"best_of": 3}, "best_of"),
    ({"n": 1000}, "n"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"model": "gpt-4"}, "model"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x " * 9000}]}, "messages"),  # over max_model_len
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"stop": [1, 2]}, "stop"),
]


@pytest.mark.parametrize(("change", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_a_bad_field_is_a_400_naming_it_and_the_next_request_is_served(front, change, param):
    body = {"model": "llm", "messages": MESSAGES, "max_tokens": 4, **change}
    response = httpx.post(f"{front}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    good = httpx.post(f"{front}/v1/chat/completions", json={"model": "llm", "messages": MESSAGES, "max_tokens": 2},
                      timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_malformed_json_and_oversized_bodies_are_refused(front):
    response = httpx.post(f"{front}/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    huge = httpx.post(f"{front}/v1/completions", json={"model": "llm", "prompt": "x" * (2 << 20)}, timeout=30)
    assert huge.status_code == 413


def test_64_concurrent_streams_all_complete(front):
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(model="llm", prompt=f"request {i}", max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [6] * 64


def test_a_client_that_disconnects_mid_stream_frees_its_kv_within_a_second(front, served):
    body = {"model": "llm", "prompt": "keep going", "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "temperature": 0}
    baseline = triton_metric(served.metrics_url, "llm_kv_cache_usage_ratio")
    with httpx.stream("POST", f"{front}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in received)
        assert triton_metric(served.metrics_url, "llm_num_requests_running") >= 1
        assert triton_metric(served.metrics_url, "llm_kv_cache_usage_ratio") > baseline
        left = time.monotonic()
    deadline = left + 1.0
    while time.monotonic() < deadline and triton_metric(served.metrics_url, "llm_kv_cache_usage_ratio") > baseline:
        time.sleep(0.05)
    assert triton_metric(served.metrics_url, "llm_kv_cache_usage_ratio") <= baseline, "KV still held 1 s later"
    assert triton_metric(served.metrics_url, "llm_num_requests_running") == 0


def test_health_follows_the_models_readiness_across_unload_and_load(make_server):
    import tritonclient.http as httpclient

    server = make_server(extra_args=["--model-control-mode=explicit", "--load-model=llm",
                                     "--load-model=tokenizer"], models=("llm", "tokenizer"))
    process, base = start_front(server.grpc_url)
    admin = httpclient.InferenceServerClient(server.http_url)
    try:
        admin.unload_model("llm")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and httpx.get(f"{base}/health").status_code != 503:
            time.sleep(0.2)
        assert httpx.get(f"{base}/health").status_code == 503
        admin.load_model("llm")
        assert httpx.get(f"{base}/health").status_code == 200
        answer = httpx.post(f"{base}/v1/completions", json={"model": "llm", "prompt": "back", "max_tokens": 2},
                            timeout=60)
        assert answer.status_code == 200
    finally:
        admin.close()
        stop_front(process)


def test_genai_perf_chat_endpoint_profiles_the_front(front, tmp_path):
    """genai-perf --service-kind openai --endpoint-type chat, briefly (the CI smoke the issue asks for)."""
    from tests.integration.test_bench_smoke import profile_with_genai_perf

    report = profile_with_genai_perf(["--url", front.removeprefix("http://"), "--endpoint-type", "chat"], tmp_path)
    assert report["request_throughput"]["avg"] > 0
    assert report["time_to_first_token"]["avg"] > 0 and report["output_token_throughput"]["avg"] > 0

def test_tritons_busy_error_and_the_fronts_stream_limit_are_503s_with_retry_after(make_server):
    """With the engine full (max_num_seqs 1) and its queue full (max_queue_len 1), a request through
    a second front gets Triton's busy error as a 503, and a third request through the first front,
    which allows 2 generations in flight, gets the front's own 503; both with Retry-After. The two
    requests that got in are answered in full."""
    import threading

    server = make_server({"max_num_seqs": "1", "max_queue_len": "1"})
    limited, limited_base = start_front(server.grpc_url, "--max-concurrent", "2")
    other, other_base = start_front(server.grpc_url)
    long = {"model": "llm", "prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    answers: dict[str, list[str]] = {}

    def stream(name: str) -> threading.Thread:
        def run():
            with httpx.stream("POST", f"{limited_base}/v1/completions", json=long, timeout=300) as response:
                answers[name] = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 60
        while triton_metric(server.metrics_url, name) < 1:
            assert time.monotonic() < deadline, f"{name} never reached 1"
            time.sleep(0.05)

    try:
        streams = [stream("running")]
        wait_for("llm_num_requests_running")
        streams.append(stream("queued"))
        wait_for("llm_num_requests_waiting")
        busy = httpx.post(f"{other_base}/v1/completions", json={"model": "llm", "prompt": "x", "max_tokens": 2},
                          timeout=60)
        over = httpx.post(f"{limited_base}/v1/completions", json=long, timeout=60)
        for thread in streams:
            thread.join(300)
    finally:
        stop_front(limited)
        stop_front(other)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
    assert "busy" in busy.json()["error"]["message"]
    assert over.status_code == 503 and over.headers["retry-after"] == "1", over.text
    assert "max_concurrent=2" in over.json()["error"]["message"]
    for name in ("running", "queued"):
        assert answers[name][-1] == "[DONE]" and json.loads(answers[name][-2])["usage"]["completion_tokens"] == 200
