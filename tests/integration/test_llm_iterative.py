"""The `llm_iterative` model (sequence batcher, iterative_sequence) through real tritonclient streams.

Same contract as `llm`: the same greedy text, exactly one final response per request, bad input
answered with an error naming the field, cancellation freeing the KV blocks.
"""

from __future__ import annotations

import time

import pytest
import tritonclient.grpc as grpcclient

from backend.config import engine_config_from_model_folder
from backend.protocol.sampling import SamplingParams
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY
from tests.integration.test_llm_model import (
    BAD_INPUTS,
    metric,
    mixed_workload,
    read_metrics,
    run_concurrently,
)

pytestmark = pytest.mark.integration

MODEL = "llm_iterative"


@pytest.fixture(scope="module")
def offline_engine(demo_model_dir):
    from backend.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / MODEL)))


def test_concurrent_streams_equal_llm_and_the_offline_engine(triton_server, offline_engine):
    workload = mixed_workload(seed=11, count=16)
    jobs = [(prompt, {"max_tokens": n, "stream": True, "ignore_eos": True}) for prompt, n in workload]
    iterative = run_concurrently(triton_server.grpc_url, jobs, model=MODEL)
    continuous = run_concurrently(triton_server.grpc_url, jobs)
    expected = offline_engine.generate(
        [p for p, _ in workload], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in workload]
    )
    for (prompt, max_tokens), result, other, reference in zip(workload, iterative, continuous, expected, strict=True):
        assert result.error is None, result.error
        assert result.num_final == 1
        assert result.token_ids == reference.output_token_ids == other.token_ids, prompt
        assert result.text == reference.text == other.text
        assert result.finish_reason == "length"
        assert result.num_output_tokens == max_tokens == len(result.token_ids)
        assert result.num_input_tokens == len(reference.prompt_token_ids)


def test_non_streaming_and_prompt_echo(triton_server):
    with StreamingClient(triton_server.grpc_url, MODEL) as client:
        streamed = client.generate("Return the number of items", max_tokens=12, stream=True)
        whole = client.generate("Return the number of items", max_tokens=12, stream=False)
        echoed = client.generate("Return the number of items", max_tokens=12, stream=True,
                                 exclude_input_in_output=False)
    assert streamed.error is None and whole.error is None and echoed.error is None
    assert whole.num_responses == 1 and whole.num_final == 1
    assert streamed.num_responses > 1 and streamed.num_final == 1
    assert whole.text == streamed.text and whole.token_ids == streamed.token_ids
    assert echoed.text == "Return the number of items" + streamed.text


def test_stop_words(triton_server):
    with StreamingClient(triton_server.grpc_url, MODEL) as client:
        free = client.generate("The quick brown fox", max_tokens=40, ignore_eos=True)
        stop = free.text[6:9]
        stopped = client.generate("The quick brown fox", max_tokens=40, ignore_eos=True, stop_words=[stop])
    assert stopped.error is None and stopped.num_final == 1 and stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


@pytest.mark.parametrize(("options", "field"), BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
def test_bad_input_gets_an_error_naming_the_field(triton_server, options, field):
    with StreamingClient(triton_server.grpc_url, MODEL) as client:
        bad = client.generate("hello", **options)
        good = client.generate("hello", max_tokens=3, ignore_eos=True)
    assert bad.error is not None and field in bad.error, bad.error
    assert bad.num_final == 1 and bad.num_responses == 0
    assert good.error is None and len(good.token_ids) == 3


def test_overlong_prompt_names_text_input(triton_server):
    with StreamingClient(triton_server.grpc_url, MODEL) as client:
        result = client.generate("cache " * 3000, max_tokens=4)
    assert result.error is not None and "text_input" in result.error and "max_model_len" in result.error


def test_cancelling_a_stream_frees_its_kv_blocks(triton_server):
    def usage():
        return metric(read_metrics(triton_server), "llm_kv_cache_usage_ratio", model=MODEL)

    baseline = usage()
    client = StreamingClient(triton_server.grpc_url, MODEL)
    client.send("a very long story about caches " * 20, max_tokens=1500, stream=True, ignore_eos=True)
    deadline = time.monotonic() + 60
    while usage() <= baseline:
        assert time.monotonic() < deadline, "the request never occupied KV blocks"
        time.sleep(0.2)
    client.close(cancel_requests=True)
    deadline = time.monotonic() + 30
    while usage() > baseline:
        assert time.monotonic() < deadline, "KV blocks were not freed after cancellation"
        time.sleep(0.2)
    with StreamingClient(triton_server.grpc_url, MODEL) as client:
        after = client.generate("still serving?", max_tokens=4, ignore_eos=True)
    assert after.error is None and len(after.token_ids) == 4


def test_request_metrics_count_requests_not_iterations(triton_server):
    before = read_metrics(triton_server)
    jobs = [(f"metrics check {i}", {"max_tokens": 5 + i, "ignore_eos": True, "stream": True}) for i in range(3)]
    results = run_concurrently(triton_server.grpc_url, jobs, model=MODEL)
    time.sleep(0.3)
    after = read_metrics(triton_server)

    def delta(name, **labels):
        return metric(after, name, model=MODEL, **labels) - metric(before, name, model=MODEL, **labels)

    assert delta("llm_request_success_total", finish_reason="length") == 3
    assert delta("llm_generation_tokens_total") == sum(len(r.token_ids) for r in results)
    assert delta("llm_time_to_first_token_seconds_count") == 3


def test_triton_statistics_show_batched_iterations(triton_server):
    jobs = [(f"batch {i}", {"max_tokens": 16, "ignore_eos": True, "stream": True}) for i in range(8)]
    run_concurrently(triton_server.grpc_url, jobs, model=MODEL)
    stats = grpcclient.InferenceServerClient(triton_server.grpc_url).get_inference_statistics(MODEL, as_json=True)
    sizes = [int(b["batch_size"]) for b in stats["model_stats"][0].get("batch_stats", [])]
    assert max(sizes) > 1, sizes
