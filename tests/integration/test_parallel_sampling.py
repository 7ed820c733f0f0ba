"""Parallel sampling (n > 1, issue 16) through tritonserver, `llm` and `llm_iterative`.

Streamed: every data response carries ``sequence_index`` and one sample's delta, exactly one
response is FINAL, and sample i's text equals the engine's sample i (seed + i) in-process.
Not streamed: one response with the n texts in order. ``num_return_sequences`` (TensorRT-LLM's
input) works like ``n``; the generation-token counter counts every sample's tokens; a bad n is
refused naming the field.
"""

from __future__ import annotations

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = pytest.mark.integration

PROMPT = "the engine shares the prompt blocks of every sample"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def expected(demo_model_dir) -> list[str]:
    engine = LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / "llm")))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, n=4, ignore_eos=True)
    return [sample.text for sample in engine.generate([PROMPT], [params])[0].samples]


def sampling(n: int) -> dict:
    return {"temperature": 0.9, "seed": 11, "n": n, "ignore_eos": True, "max_tokens": MAX_TOKENS}


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_n_streamed_sends_indexed_deltas_and_one_final(triton_server, expected, model):
    before = metric(read_metrics(triton_server), "llm_generation_tokens_total", model=model)
    with StreamingClient(triton_server.grpc_url, model) as client:
        result = client.generate(PROMPT, stream=True, sampling_parameters=sampling(4), timeout=120)
    assert result.error is None and result.num_final == 1
    assert result.num_responses >= 4  # one sample per response
    assert [result.sample_texts[i] for i in range(4)] == expected
    assert all(len(result.sample_token_ids[i]) == MAX_TOKENS for i in range(4))
    assert result.sample_finish_reasons == {i: "length" for i in range(4)}
    after = metric(read_metrics(triton_server), "llm_generation_tokens_total", model=model)
    assert after - before == 4 * MAX_TOKENS


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_n_not_streamed_sends_one_response_with_the_texts_in_order(triton_server, expected, model):
    with StreamingClient(triton_server.grpc_url, model) as client:
        result = client.generate(PROMPT, stream=False, sampling_parameters=sampling(4), timeout=120)
        trt = client.generate(PROMPT, stream=False, num_return_sequences=3, temperature=0.9, random_seed=11,
                              ignore_eos=True, max_tokens=MAX_TOKENS, timeout=120)
    assert result.error is None and result.num_responses == 1 and result.num_final == 1
    assert [result.sample_texts[i] for i in range(4)] == expected
    assert [len(result.sample_token_ids[i]) for i in range(4)] == [MAX_TOKENS] * 4
    assert trt.error is None and [trt.sample_texts[i] for i in range(3)] == expected[:3]


def test_a_bad_n_is_refused_naming_the_field(triton_server):
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate(PROMPT, sampling_parameters={"n": 17}, timeout=60)
        still = client.generate(PROMPT, max_tokens=2, timeout=60)
    assert result.error is not None and "n/num_return_sequences" in result.error
    assert still.error is None and len(still.token_ids) == 2


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_log_prob_outputs_carry_the_chosen_and_the_k_best_tokens(triton_server, model, demo_model_dir):
    engine = LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / model)))
    offline = engine.generate([PROMPT], [SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True)])[0]
    with StreamingClient(triton_server.grpc_url, model) as client:
        result = client.generate(PROMPT, stream=True, timeout=120,
                                 sampling_parameters={"logprobs": 3, "max_tokens": 6, "ignore_eos": True})
    assert result.error is None and result.token_ids == offline.output_token_ids
    assert result.output_log_probs == pytest.approx(offline.logprobs, abs=1e-5)
    assert len(result.top_logprobs) == 6 and all(len(top) == 3 for top in result.top_logprobs)
    for token, top in zip(result.token_ids, result.top_logprobs, strict=True):
        assert top[0]["token_id"] == token and top[0]["text"] == engine.tokenizer.decode([token])  # greedy: the best
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    assert result.cumulative_logprob == pytest.approx(sum(offline.logprobs), abs=1e-4), result.extras
