"""The `llm` model through real tritonclient gRPC streams (issue: the product itself)."""

from __future__ import annotations

import os
import random
import re
import threading
import time
import urllib.request

import pytest
import tritonclient.http as httpclient

from backend.config import engine_config_from_model_folder
from backend.protocol.sampling import SamplingParams
from client.stream import StreamingClient
from perf.cpu_contention import start_busy_neighbor
from tests.integration.conftest import MODEL_REPOSITORY

pytestmark = pytest.mark.integration


def read_metrics(server, prefixes: tuple[str, ...] = ("llm_",)) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for the series whose names start with ``prefixes``
    (our llm_* ones by default)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels) -> float:
    wanted = {"model": "llm", **labels}
    for key, value in values.items():
        match = re.fullmatch(r"([a-zA-Z0-9_:]+)\{(.*)\}", key)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if all(found.get(k) == v for k, v in wanted.items()) and ("le" in wanted or "le" not in found):
            return value
    raise KeyError(f"{name}{labels} not in metrics")


@pytest.fixture(scope="module")
def offline_engine(demo_model_dir):
    """The very engine the server builds, in-process, to compare outputs against."""
    from backend.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / "llm")))


def mixed_workload(seed: int, count: int):
    rng = random.Random(seed)
    words = ("the", "server", "streams", "tokens", "cache", "block", "prefix", "über", "東京", "—", "data", "and")
    return [
        (" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))), rng.randint(1, 48))
        for _ in range(count)
    ]


def run_concurrently(url: str, jobs: list[tuple[str, dict]], timeout: float = 600.0, model: str = "llm"):
    """One stream per job, all in flight at once (as perf_analyzer's concurrency does)."""
    results = [None] * len(jobs)
    errors = []

    def worker(index, prompt, options):
        try:
            with StreamingClient(url, model) as client:
                results[index] = client.generate(prompt, timeout=timeout, **options)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, p, o)) for i, (p, o) in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 30)
    assert not errors, errors
    return results


def test_32_concurrent_streams_equal_the_offline_engine(triton_server, offline_engine):
    workload = mixed_workload(seed=7, count=32)
    jobs = [(prompt, {"max_tokens": n, "stream": True, "ignore_eos": True}) for prompt, n in workload]
    results = run_concurrently(triton_server.grpc_url, jobs)
    expected = offline_engine.generate(
        [p for p, _ in workload], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in workload]
    )
    for (prompt, max_tokens), result, reference in zip(workload, results, expected, strict=True):
        assert result.error is None, result.error
        assert result.num_final == 1
        assert result.token_ids == reference.output_token_ids, prompt
        assert result.text == reference.text
        assert result.finish_reason == "length"
        assert result.num_output_tokens == max_tokens == len(result.token_ids)
        assert result.num_input_tokens == len(reference.prompt_token_ids)


def test_streaming_and_non_streaming_give_the_same_text(triton_server):
    with StreamingClient(triton_server.grpc_url) as client:
        streamed = client.generate("Return the number of items", max_tokens=24, stream=True)
        whole = client.generate("Return the number of items", max_tokens=24, stream=False)
    assert streamed.error is None and whole.error is None
    assert whole.num_responses == 1 and whole.num_final == 1
    assert streamed.num_responses > 1
    assert whole.text == streamed.text and whole.token_ids == streamed.token_ids
    assert whole.finish_reason == streamed.finish_reason


def test_http_generate_stream_gives_what_the_grpc_stream_gives(triton_server):
    """Triton's HTTP generate_stream endpoint (client.triton_http_stream, the load generator's
    http-stream-per-user) streams the same greedy tokens, one response per token, and the counts;
    a bad input is an error naming the field, on that request only."""
    from client.triton_http_stream import TritonHTTPStreamingClient

    prompt = "Return the number of items"
    with StreamingClient(triton_server.grpc_url) as client:
        expected = client.generate(prompt, max_tokens=24, stream=True, ignore_eos=True)
    with TritonHTTPStreamingClient(triton_server.http_url) as client:
        responses = []
        got = client.generate(prompt, on_response=lambda _rid, r: responses.append(len(r.token_ids)),
                              max_tokens=24, stream=True, ignore_eos=True)
        bad = client.generate(prompt, max_tokens=24, stream=True, temperature=-1.0)
        again = client.generate(prompt, max_tokens=24, stream=True, ignore_eos=True)  # the same connection
    assert got.error is None and expected.error is None
    assert got.text == expected.text and got.token_ids == expected.token_ids and len(got.token_ids) == 24
    assert responses == list(range(1, 25)) and len(got.token_times) == 24
    assert got.num_output_tokens == 24 and got.num_input_tokens == expected.num_input_tokens
    assert got.finish_reason == expected.finish_reason == "length"
    assert bad.error is not None and "temperature" in bad.error
    assert again.error is None and again.token_ids == expected.token_ids


def test_empty_prompt_generates_from_the_bos_token(triton_server):
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate("", max_tokens=5, ignore_eos=True)
    assert result.error is None
    assert result.num_input_tokens == 1  # the BOS token alone
    assert len(result.token_ids) == 5


def test_stop_words_end_the_stream_and_are_not_in_the_text(triton_server):
    with StreamingClient(triton_server.grpc_url) as client:
        free = client.generate("The quick brown fox", max_tokens=40, ignore_eos=True)
        assert free.error is None and len(free.text) > 10
        stop = free.text[6:9]
        stopped = client.generate("The quick brown fox", max_tokens=40, ignore_eos=True, stop_words=[stop])
    assert stopped.error is None and stopped.num_final == 1
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)


def test_cancelling_a_stream_frees_its_kv_blocks(triton_server):
    baseline = metric(read_metrics(triton_server), "llm_kv_cache_usage_ratio")
    client = StreamingClient(triton_server.grpc_url)
    client.send("a very long story about caches " * 20, max_tokens=1500, stream=True, ignore_eos=True)
    deadline = time.monotonic() + 60
    while metric(read_metrics(triton_server), "llm_kv_cache_usage_ratio") <= baseline:
        assert time.monotonic() < deadline, "the request never occupied KV blocks"
        time.sleep(0.2)
    client.close(cancel_requests=True)
    deadline = time.monotonic() + 30
    while metric(read_metrics(triton_server), "llm_kv_cache_usage_ratio") > baseline:
        assert time.monotonic() < deadline, "KV blocks were not freed after cancellation"
        time.sleep(0.2)
    with StreamingClient(triton_server.grpc_url) as client:
        after = client.generate("still serving?", max_tokens=4, ignore_eos=True)
    assert after.error is None and len(after.token_ids) == 4


BAD_INPUTS = [
    ({"text_input_bytes": b"\xff\xfe not utf-8"}, "text_input"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"sampling_parameters": "{broken"}, "sampling_parameters"),
    ({"sampling_parameters": '{"best_of": 2}'}, "sampling_parameters"),
    ({"max_tokens": 4, "min_length": 8}, "min_length"),
]


@pytest.mark.parametrize(("options", "field"), BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
def test_bad_input_gets_an_error_naming_the_field_and_the_server_keeps_serving(triton_server, options, field):
    with StreamingClient(triton_server.grpc_url) as client:
        bad = client.generate("hello", **options)
        good = client.generate("hello", max_tokens=3, ignore_eos=True)
    assert bad.error is not None and field in bad.error, bad.error
    assert bad.num_final == 1 and bad.num_responses == 0
    assert good.error is None and len(good.token_ids) == 3


def test_input_ids_are_a_prompt_already_tokenized_and_a_repeat_reports_its_cached_tokens(triton_server,
                                                                                       demo_model_dir):
    """input_ids give the tokens their text gives; an id outside the vocabulary, or ids beside a
    text_input, are refused naming input_ids; the same long prompt again is found in the prefix cache."""
    from backend.engine.tokenizer import load_tokenizer

    text = "Return the number of items " * 8
    ids = load_tokenizer(str(demo_model_dir))(text)["input_ids"]
    with StreamingClient(triton_server.grpc_url) as client:
        by_text = client.generate(text, max_tokens=12, ignore_eos=True)
        by_ids = client.generate(None, input_ids=ids, max_tokens=12, ignore_eos=True, return_num_input_tokens=True)
        again = client.generate(None, input_ids=ids, max_tokens=2, return_num_input_tokens=True)
        bad = client.generate(None, input_ids=[10**8], max_tokens=2)
        both = client.generate("x", input_ids=ids, max_tokens=2)
    assert by_text.error is None and by_ids.error is None and by_ids.token_ids == by_text.token_ids
    assert by_ids.num_input_tokens == again.num_input_tokens == len(ids)
    assert again.num_cached_tokens >= len(ids) - 17  # every full block but the one holding the last token
    assert bad.error is not None and bad.error.startswith("input_ids: 100000000 is not a token id")
    assert both.error is not None and "input_ids" in both.error


def test_missing_text_input_and_overlong_prompt_name_text_input(triton_server):
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    tensor = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    with pytest.raises(Exception) as info:
        client.infer("llm", [tensor])  # decoupled models reject unary infer; use a stream below
    del info
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("llm", [tensor], enable_empty_final_response=True)
    client.stop_stream()
    assert errors and errors[0] is not None and "text_input" in str(errors[0])
    with StreamingClient(triton_server.grpc_url) as stream:
        long_prompt = stream.generate("cache " * 3000, max_tokens=4)
    assert long_prompt.error is not None and "text_input" in long_prompt.error
    assert "max_model_len" in long_prompt.error


def test_metrics_agree_with_what_clients_saw(triton_server):
    before = read_metrics(triton_server)
    jobs = [(f"metrics check {i}", {"max_tokens": 5 + i, "ignore_eos": True, "stream": True}) for i in range(4)]
    results = run_concurrently(triton_server.grpc_url, jobs)
    time.sleep(0.5)
    after = read_metrics(triton_server)
    streamed = sum(len(r.token_ids) for r in results)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("llm_generation_tokens_total") == streamed
    assert delta("llm_prompt_tokens_total") == sum(r.num_input_tokens for r in results)
    assert delta("llm_request_success_total", finish_reason="length") == 4
    assert delta("llm_time_to_first_token_seconds_count") == 4
    assert delta("llm_e2e_request_latency_seconds_count") == 4
    assert delta("llm_inter_token_latency_seconds_count") == streamed - 4
    assert delta("llm_request_generation_tokens_sum") == streamed
    for name in ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_cache_usage_ratio",
                 "llm_prefix_cache_queries_total", "llm_prefix_cache_hits_total", "llm_num_preemptions_total",
                 "llm_time_per_output_token_seconds_count", "llm_request_queue_time_seconds_count",
                 "llm_engine_cpu_thread_reductions_total"):
        metric(after, name)  # present
    # The engine core's torch threads, one per core unless other work took some (cpu_adaptive_threads).
    cores = len(os.sched_getaffinity(0))
    threads = metric(after, "llm_engine_cpu_threads")
    assert threads == 0 if cores < 2 else 1 <= threads <= cores


def test_busy_beyond_max_queue_len(make_server):
    server = make_server({"max_num_seqs": "1", "max_queue_len": "1"})
    first = StreamingClient(server.grpc_url)
    first.send("first", max_tokens=400, stream=True, ignore_eos=True)
    deadline = time.monotonic() + 60
    while metric(read_metrics(server), "llm_num_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    second = StreamingClient(server.grpc_url)
    second.send("second", max_tokens=2, stream=True, ignore_eos=True)
    while metric(read_metrics(server), "llm_num_requests_waiting") < 1:  # a fixed sleep lost the race on a slow VM
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with StreamingClient(server.grpc_url) as third:
        busy = third.generate("third", max_tokens=2)
    assert busy.error is not None and "busy" in busy.error and "max_queue_len" in busy.error
    first.close(cancel_requests=True)
    second.close()


def test_unload_and_reload_with_streams_in_flight(make_server):
    server = make_server(extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    jobs_done = []

    def stream_one(i):
        with StreamingClient(server.grpc_url) as client:
            jobs_done.append(client.generate(f"in flight {i}", max_tokens=600, ignore_eos=True, timeout=120))

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    admin = httpclient.InferenceServerClient(server.http_url)
    admin.unload_model("llm")
    for thread in threads:
        thread.join(150)
    assert all(not t.is_alive() for t in threads), "a stream hung across the unload"
    assert len(jobs_done) == 4
    for result in jobs_done:
        assert result.num_final == 1
        assert result.error is not None or result.finish_reason == "length"
    # Triton 2.51 lets in-flight requests finish before finalize(); either way none may hang.
    deadline = time.monotonic() + 60
    while admin.is_model_ready("llm"):
        assert time.monotonic() < deadline, "the model never unloaded"
        time.sleep(0.5)
    admin.load_model("llm")
    deadline = time.monotonic() + 180
    while not admin.is_model_ready("llm"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    with StreamingClient(server.grpc_url) as client:
        again = client.generate("after reload", max_tokens=3, ignore_eos=True)
    assert again.error is None and len(again.token_ids) == 3
    admin.close()  # an open HTTP connection keeps tritonserver's stop waiting its 30 s exit timeout


def test_prompt_logprobs_through_the_server_equal_the_engines(triton_server, offline_engine):
    prompt = "the server streams tokens from the cache and the prefix " * 12  # several prefill chunks
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate(prompt, max_tokens=3, stream=True, exclude_input_in_output=False,
                                 sampling_parameters={"prompt_logprobs": 0})
        plain = client.generate(prompt, max_tokens=3, stream=True)
    assert result.error is None and result.prompt_logprobs is not None
    expected = offline_engine.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=0))[0]
    assert len(result.prompt_logprobs) == result.num_input_tokens - 1 == len(expected.prompt_logprobs)
    assert max(abs(a - b) for a, b in zip(result.prompt_logprobs, expected.prompt_logprobs, strict=True)) < 1e-4
    assert result.token_ids[: result.num_input_tokens] == expected.prompt_token_ids
    assert plain.prompt_logprobs is None and plain.token_ids == result.token_ids[result.num_input_tokens:]


def stream_until(server, client, done, max_tokens: int, failure: str, timeout: float = 120) -> None:
    """Streams ``max_tokens``-token requests until ``done(metrics)``."""
    deadline = time.monotonic() + timeout
    while not done(read_metrics(server)):
        assert time.monotonic() < deadline, failure
        result = client.generate("Tell me about lighthouses.", max_tokens=max_tokens, ignore_eos=True, stream=True)
        assert result.error is None and len(result.token_ids) == max_tokens


def test_the_engine_sheds_threads_beside_busy_processes_and_takes_them_back(triton_server):
    """cpu_adaptive_threads (on by default) end to end: with a busy process per core in sessions of
    their own, the served engine core cuts its torch threads (llm_engine_cpu_threads below the
    cores, llm_engine_cpu_thread_reductions_total up) and streams on; once they are gone, streaming
    brings every thread back."""
    cores = len(os.sched_getaffinity(0))
    client = StreamingClient(triton_server.grpc_url)
    try:
        stream_until(triton_server, client, lambda m: metric(m, "llm_engine_cpu_threads") == cores, 64,
                     "the engine never ran on every core")
        cuts = metric(read_metrics(triton_server), "llm_engine_cpu_thread_reductions_total")
        neighbors = [start_busy_neighbor() for _ in range(cores)]
        try:
            stream_until(triton_server, client,
                         lambda m: metric(m, "llm_engine_cpu_thread_reductions_total") > cuts, 16,
                         "the engine's threads were never cut beside busy processes")
            assert 1 <= metric(read_metrics(triton_server), "llm_engine_cpu_threads") < cores
        finally:
            for neighbor in neighbors:
                neighbor.kill()
                neighbor.wait()
        stream_until(triton_server, client, lambda m: metric(m, "llm_engine_cpu_threads") == cores, 64,
                     "the engine's threads never came back once the CPUs were free")
    finally:
        client.close()
