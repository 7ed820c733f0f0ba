"""The default model (SmolLM2-135M-Instruct) through a real tritonserver: chat, and the tensor sets of
Triton's vLLM backend and of Triton's OpenAI frontend (its request format for Python models)."""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from transformers import AutoTokenizer

from backend.config import engine_config_from_model_folder
from backend.paths import REPO_ROOT
from backend.server.launcher import start_server
from client.stream import StreamingClient

pytestmark = pytest.mark.integration

REPOSITORY = REPO_ROOT / "model_repository"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def real_server():
    from backend.models.smollm2_model import build

    build()  # made by make setup; a no-op then
    server = start_server(REPOSITORY, ready_timeout=300)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer():
    """Loaded exactly as the server loads it: from the served model's tokenizer folder."""
    return AutoTokenizer.from_pretrained(engine_config_from_model_folder(str(REPOSITORY / "llm")).model.tokenizer_dir)


def generate(server, prompt, **options):
    with StreamingClient(server.grpc_url) as client:
        result = client.generate(prompt, timeout=120, **options)
    assert result.num_final == 1
    return result


def test_chat_streams_the_same_tokens_as_its_rendered_prompt_and_answers_sensibly(real_server, tokenizer):
    chat = generate(real_server, None, messages=QUESTION, max_tokens=24, stream=True)
    rendered = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    plain = generate(real_server, rendered, max_tokens=24, stream=True)
    assert chat.error is None and plain.error is None
    assert chat.token_ids == plain.token_ids and chat.text == plain.text
    assert chat.num_input_tokens == len(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"])
    assert "Paris" in chat.text and chat.finish_reason == "eos"
    assert len(chat.deltas) > 3  # streamed, not sent at once


def test_prompt_tokens_inside_the_server_equal_the_tokenizer_outside(real_server, tokenizer):
    prompt = "Über Zürich, 東京 and 12345 — naïve café"
    result = generate(real_server, prompt, max_tokens=2, exclude_input_in_output=False)
    expected = tokenizer(prompt)["input_ids"]
    assert result.token_ids[: len(expected)] == expected and result.text.startswith(prompt)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"messages": "not json"}, "messages: malformed JSON"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role: expected one of"),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content: expected a string"),
        ({"messages": []}, "messages: expected a non-empty JSON array"),
    ],
)
def test_bad_messages_get_an_error_naming_the_field(real_server, options, message):
    result = generate(real_server, None, max_tokens=4, **options)
    assert result.error is not None and result.error.startswith(message), result.error


def test_text_input_and_messages_together_are_refused(real_server):
    result = generate(real_server, "hello", messages=QUESTION, max_tokens=4)
    assert result.error.startswith("text_input, messages: send exactly one")


def test_vllm_backend_return_flags_give_that_backends_outputs(real_server, tokenizer):
    result = generate(
        real_server, None, messages=[{"role": "user", "content": "Name three colors."}], stream=True,
        return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
        return_cumulative_logprob=True, return_logprobs=True,
        sampling_parameters={"max_tokens": "12", "temperature": "0", "logprobs": 2, "n": 1},
    )
    assert result.error is None
    extras = result.extras
    assert [e["finish_reason"] for e in extras[:-1]] == ["None"] * (len(extras) - 1)
    assert extras[-1]["finish_reason"] in ("stop", "length")
    assert {e["num_input_tokens"] for e in extras} == {result.num_input_tokens}
    assert sum(e["num_output_tokens"] for e in extras) == len(result.token_ids)  # the OpenAI frontend's usage sum
    entries = [entry for e in extras for entry in e["logprobs"]]
    assert len(entries) == len(result.token_ids)
    running = 0.0
    for extra, token_id in zip(extras, result.token_ids, strict=True):
        (entry,) = extra["logprobs"]
        chosen = entry[str(token_id)]
        assert chosen["decoded_token"] == tokenizer.decode([token_id])
        assert chosen["rank"] == 1  # greedy
        assert len(entry) <= 3  # the chosen token plus the 2 top tokens (it is one of them)
        running += chosen["logprob"]
        assert math.isclose(extra["cumulative_logprob"], running, rel_tol=1e-5, abs_tol=1e-5)


def test_without_return_flags_the_schema_stays_ours(real_server):
    result = generate(real_server, "The capital of France is", max_tokens=6, ignore_eos=True, stream=True)
    assert [e["finish_reason"] for e in result.extras] == [""] * 5 + ["length"]
    assert all("num_output_tokens" not in e for e in result.extras[:-1])
    assert result.extras[-1]["num_output_tokens"] == 6 and result.extras[-1]["num_input_tokens"] == result.num_input_tokens


def test_non_streaming_vllm_request_returns_everything_in_one_response(real_server):
    result = generate(real_server, "The capital of France is", stream=False, return_num_output_tokens=True,
                      return_logprobs=True, sampling_parameters={"max_tokens": 5, "ignore_eos": True, "logprobs": 0})
    assert result.error is None and result.num_responses == 1
    (extra,) = result.extras
    assert extra["num_output_tokens"] == 5 and len(extra["logprobs"]) == 5
    assert all(len(entry) == 1 for entry in extra["logprobs"])  # logprobs 0: only the chosen token


def test_the_openai_frontends_request_for_a_python_model_is_served(real_server):
    """Triton's OpenAI frontend sends a Python-backend model its TensorRT-LLM request format."""
    result = generate(real_server, "Once upon a time", stream=True, max_tokens=8, top_p=1.0, temperature=0.0,
                      seed=3, frequency_penalty=0.0, presence_penalty=0.0, stop_words=["\n\n"],
                      exclude_input_in_output=True, return_num_input_tokens=True, return_num_output_tokens=True)
    assert result.error is None and 0 < len(result.token_ids) <= 8
    assert sum(e["num_output_tokens"] for e in result.extras) == len(result.token_ids)
    assert all(e["num_input_tokens"] == result.num_input_tokens for e in result.extras)


def test_a_model_without_a_chat_template_refuses_messages(triton_server):
    """The session's server runs the demo model, whose tokenizer has no chat template."""
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate(None, timeout=60, messages=QUESTION, max_tokens=4)
    assert result.error.startswith("messages: this model has no chat template")


def test_the_served_config_declares_both_tensor_sets(real_server):
    with urllib.request.urlopen(f"http://{real_server.http_url}/v2/models/llm/config", timeout=10) as response:
        config = json.load(response)
    inputs = {i["name"]: i["data_type"] for i in config["input"]}
    outputs = {o["name"]: o["data_type"] for o in config["output"]}
    for name in ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                 "return_num_output_tokens", "exclude_input_in_output", "stream"):
        assert inputs[name] == "TYPE_BOOL", name
    assert inputs["sampling_parameters"] == inputs["text_input"] == inputs["messages"] == "TYPE_STRING"
    assert inputs["seed"] == "TYPE_UINT64" and inputs["frequency_penalty"] == "TYPE_FP32"
    assert outputs["cumulative_logprob"] == "TYPE_FP32" and outputs["logprobs"] == "TYPE_STRING"
    assert outputs["num_output_tokens"] == "TYPE_INT32"  # the OpenAI frontend reads INT32 or UINT32


def test_a_chat_constrained_to_a_json_schema_streams_json_that_validates(real_server):
    import jsonschema

    # The number is bounded so that the grammar itself ends it: greedy bf16 SmolLM2 on some CPUs (AMX's
    # bf16 GEMMs) repeats a digit for ever, and an unbounded "number" lets it run to max_tokens.
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 1000}},
              "required": ["city", "country", "population_millions"]}
    question = [{"role": "user", "content": "Describe Paris as JSON with city, country and population_millions."}]
    result = generate(real_server, None, messages=question, max_tokens=96, stream=True,
                      sampling_parameters={"structured_outputs": {"json": schema}})
    assert result.error is None and result.finish_reason == "stop", result
    value = json.loads(result.text)
    jsonschema.validate(value, schema)
    assert value["city"] == "Paris" and len(result.deltas) > 5
