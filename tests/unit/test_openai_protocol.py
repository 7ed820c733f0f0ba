"""openai_front's request checks and answer shapes, without a server."""

from __future__ import annotations

import json

import pytest

from openai_front.errors import ApiError, from_triton
from openai_front.protocol import Limits, parse_chat, parse_completion
from openai_front.responses import Choice, ChunkWriter, Usage, full_response

SERVED = ("llm",)
CHAT = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return parse_chat({**CHAT, **fields}, Limits(), SERVED)


def test_chat_fields_become_the_llm_models_sampling_parameters():
    request = chat(max_completion_tokens=9, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, n=2,
                   stop="END", stop_token_ids=[2], presence_penalty=0.1, frequency_penalty=0.2,
                   repetition_penalty=1.1, ignore_eos=True, min_tokens=1, priority=4, logprobs=True,
                   top_logprobs=3, stream=True, stream_options={"include_usage": True}, user="u",
                   response_format={"type": "json_object"})
    assert request.sampling == {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "min_p": 0.1,
                                "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
                                "top_k": 5, "seed": 3, "min_tokens": 1, "priority": 4, "ignore_eos": True,
                                "stop_token_ids": [2], "stop": ["END"], "structured_outputs": {"json_object": True},
                                "n": 2, "logprobs": 3}
    assert request.stream and request.include_usage and request.n == 2 and request.logprobs == 3


def test_json_schema_and_guided_fields_become_structured_outputs():
    schema = {"type": "object"}
    request = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert request.sampling["structured_outputs"] == {"json": schema}
    assert chat(guided_regex="a+").sampling["structured_outputs"] == {"regex": "a+"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"logit_bias": {"3": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"best_of": 2}, "best_of"), ({"n": 9}, "n"),
    ({"n": 0}, "n"), ({"max_tokens": 10**6}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "x"}, "temperature"), ({"model": "other"}, "model"), ({"model": None}, "model"),
    ({"mystery": 1}, "mystery"), ({"messages": "hi"}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"stop": [1]}, "stop"), ({"stop": ["s"] * 33}, "stop"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"stream_options": {"include_usage": True}},
                                                               "stream_options"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"modalities": ["audio"]}, "modalities"),
])
def test_each_bad_chat_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as refused:
        chat(**fields)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["param"] == param


def test_completion_prompts_echo_and_logprobs():
    request = parse_completion({"model": "llm", "prompt": ["a", "b"], "n": 2, "echo": True, "logprobs": 2,
                                "best_of": 2}, Limits(), SERVED)
    assert request.prompts == ["a", "b"] and request.echo and request.logprobs == 2 and request.n == 2
    for bad, param in (({"prompt": [1, "a"]}, "prompt"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": [-1]}, "prompt"),
                       ({"prompt": None}, "prompt"), ({"suffix": "x"}, "suffix"),
                       ({"prompt": ["a"] * 65}, "prompt"), ({"prompt": ["a"] * 40, "n": 2}, "n")):
        with pytest.raises(ApiError) as refused:
            parse_completion({"model": "llm", "prompt": "x", **bad}, Limits(), SERVED)
        assert refused.value.param == param


def test_triton_errors_map_to_statuses_and_fields():
    busy = from_triton("server busy: 9 requests are waiting (max_queue_len=8); retry later")
    assert busy.status == 503 and busy.headers() == {"Retry-After": "1"}
    assert from_triton("the model is being unloaded").status == 503
    assert from_triton("internal error while reading the request: KeyError").status == 500
    too_long = from_triton("text_input: the prompt has 9000 tokens; max_model_len is 8192")
    assert too_long.status == 400 and too_long.param == "prompt"
    assert from_triton("sampling_parameters.top_p: must be in (0, 1]").param == "top_p"


def test_answers_have_openais_shapes():
    choices = [Choice(1, "b", "length"), Choice(0, "a", "stop")]
    body = full_response("chatcmpl-1", True, "llm", choices, Usage(3, 4), None)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "a"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    entries = [{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
                "6": {"logprob": -1.0, "rank": 2, "decoded_token": "y"}}]
    writer = ChunkWriter("chatcmpl-1", True, "llm", 2)
    events = writer.delta(0, "x", None, entries).split("\n\n")[:-1]
    first, second = (json.loads(e.removeprefix("data: ")) for e in events)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    top = second["choices"][0]["logprobs"]["content"][0]
    assert top["token"] == "x" and [t["token"] for t in top["top_logprobs"]] == ["x", "y"]
    assert writer.done() == "data: [DONE]\n\n"
    completion = full_response("cmpl-1", False, "llm", [Choice(0, "x", "stop", entries)], Usage(1, 1), 1)
    assert completion["choices"][0]["logprobs"]["tokens"] == ["x"]
    assert completion["choices"][0]["logprobs"]["top_logprobs"] == [{"x": -0.5}]


def test_kv_transfer_params_pass_through_and_come_back_at_the_top_of_the_answer():
    """vllm-router's PD legs: the body's object goes to the `llm` model as is (it checks every key);
    a prefill engine's answer carries its own at the top level, where the router reads it."""
    leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_host": None}
    for parse, body in ((parse_chat, {"messages": [{"role": "user", "content": "hi"}]}),
                        (parse_completion, {"prompt": "hi"})):
        request = parse({"model": "llm", "max_tokens": 1, "kv_transfer_params": leg, **body}, Limits(), ("llm",))
        assert request.sampling["kv_transfer_params"] == leg
        with pytest.raises(ApiError) as bad:
            parse({"model": "llm", "kv_transfer_params": "do_remote_decode", **body}, Limits(), ("llm",))
        assert bad.value.param == "kv_transfer_params"
    with pytest.raises(ApiError, match="one prompt per disaggregated request"):
        parse_completion({"model": "llm", "prompt": ["a", "b"], "kv_transfer_params": leg}, Limits(), ("llm",))
    answer = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600, "transfer_token": "t" * 43}
    body = full_response("cmpl-1", False, "llm", [Choice(0, "x", "length")], Usage(3, 1), None, answer)
    assert body["kv_transfer_params"] == answer
    assert "kv_transfer_params" not in full_response("cmpl-1", False, "llm", [Choice(0, "x", "length")], Usage(3, 1), None)


def test_logit_bias_goes_to_the_llm_model_as_its_sampling_parameter():
    assert chat(logit_bias={"3": 5, "17": -100}).sampling["logit_bias"] == {"3": 5.0, "17": -100.0}
    assert "logit_bias" not in chat(logit_bias={}).sampling


def test_completion_prompts_may_be_token_ids_or_lists_of_them():
    assert parse_completion({"model": "llm", "prompt": [1, 2, 3]}, Limits(), SERVED).prompts == [[1, 2, 3]]
    assert parse_completion({"model": "llm", "prompt": [[4], [5, 6]]}, Limits(), SERVED).prompts == [[4], [5, 6]]
