"""Parsing of the `llm` model's input tensors: every bad input names its field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.engine.input_processor import InputProcessor
from backend.triton.inputs import InputError, parse_request


def tensors(**values):
    arrays = {}
    for name, value in values.items():
        if name in ("text_input", "sampling_parameters"):
            arrays[name] = np.array([[value if isinstance(value, bytes) else value.encode()]], dtype=np.object_)
        elif name == "stop_words":
            arrays[name] = np.array([[w.encode() for w in value]], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.array([[value]], dtype=bool)
        elif isinstance(value, float):
            arrays[name] = np.array([[value]], dtype=np.float32)
        else:
            arrays[name] = np.array([[value]], dtype=np.int32)
    return arrays.get


# The engine's one check, on an engine of max_model_len 1001 and a 50,000-token vocabulary (the
# method needs nothing else of the engine).
CHECK = InputProcessor(None, vocab_size=50000, max_model_len=1001, default_max_tokens=32).check_sampling_params


def parse(**values):
    return parse_request(tensors(**values), check=CHECK)


def test_defaults_and_single_inputs():
    parsed = parse(text_input="hi", max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, stream=True,
                   stop_words=["\n\n", "END"], ignore_eos=True)
    params = parsed.sampling_params
    assert parsed.prompt == "hi" and parsed.stream and parsed.exclude_input_in_output
    assert (params.max_tokens, params.temperature, params.top_k, params.stop, params.ignore_eos) == (
        5, 0.5, 3, ["\n\n", "END"], True)
    assert abs(params.top_p - 0.9) < 1e-6
    assert parse(text_input="x").sampling_params.max_tokens == 32


def test_sampling_parameters_json_overrides_single_inputs():
    parsed = parse(text_input="x", max_tokens=5,
                   sampling_parameters=json.dumps({"max_tokens": 7, "top_k": -1, "stop": "###", "seed": 3,
                                                   "stream": True}))
    assert parsed.sampling_params.max_tokens == 7
    assert parsed.sampling_params.top_k == 0
    assert parsed.sampling_params.stop == ["###"]
    assert parsed.sampling_params.seed == 3
    assert parsed.stream


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({}, "text_input"),
        ({"text_input": b"\xff\xfe bad"}, "text_input"),
        ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "x", "max_tokens": -3}, "max_tokens"),
        ({"text_input": "x", "max_tokens": 5000}, "max_tokens"),
        ({"text_input": "x", "temperature": -0.1}, "temperature"),
        ({"text_input": "x", "temperature": float("nan")}, "temperature"),
        ({"text_input": "x", "top_p": 0.0}, "top_p"),
        ({"text_input": "x", "top_p": 1.5}, "top_p"),
        ({"text_input": "x", "top_k": -1}, "top_k"),
        ({"text_input": "x", "max_tokens": 4, "min_length": 9}, "min_length"),
        ({"text_input": "x", "sampling_parameters": "{not json"}, "sampling_parameters"),
        ({"text_input": "x", "sampling_parameters": '{"tempurature": 1}'}, "sampling_parameters"),
        ({"text_input": "x", "sampling_parameters": "[1, 2]"}, "sampling_parameters"),
        ({"text_input": "x", "sampling_parameters": '{"top_p": "high"}'}, "sampling_parameters.top_p"),
    ],
)
def test_bad_inputs_name_their_field(values, field):
    with pytest.raises(InputError) as info:
        parse(**values)
    assert str(info.value).startswith(field), str(info.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # Issue 20: RecursionError used to escape json.loads and fail the whole dynamic batch.
        ({"sampling_parameters": "[" * 3000 + "]" * 3000}, "sampling_parameters: JSON nested too deeply"),
        ({"sampling_parameters": '{"a":' * 3000 + "1" + "}" * 3000}, "sampling_parameters: JSON nested too deeply"),
        ({"sampling_parameters": json.dumps({"stop": "x" * 70000})}, "sampling_parameters: 70012 characters"),
        ({"sampling_parameters": json.dumps({"stop": [str(i) for i in range(33)]})}, "stop: at most 32 stop strings"),
        ({"sampling_parameters": json.dumps({"stop": ["y" * 1025]})}, "stop: a stop string is 1025 bytes"),
        ({"stop_words": ["é" * 600]}, "stop: a stop string is 1200 bytes"),
        ({"sampling_parameters": json.dumps({"stop_token_ids": list(range(1025))})}, "stop_token_ids: at most 1024"),
        ({"sampling_parameters": json.dumps({"stop_token_ids": [1, "2"]})}, "sampling_parameters.stop_token_ids"),
        ({"sampling_parameters": '{"max_tokens": 1e999}'}, "sampling_parameters.max_tokens"),
        ({"sampling_parameters": '{"temperature": NaN}'}, "sampling_parameters.temperature"),
        ({"sampling_parameters": json.dumps({"logit_bias": [1]})}, "sampling_parameters.logit_bias: expected an object"),
        ({"sampling_parameters": json.dumps({"logit_bias": {str(i): 1 for i in range(301)}})},
         "sampling_parameters.logit_bias: at most 300 entries"),
        ({"sampling_parameters": json.dumps({"logit_bias": {"one": 1}})}, "sampling_parameters.logit_bias key"),
        ({"sampling_parameters": json.dumps({"logit_bias": {"1": "x"}})}, "sampling_parameters.logit_bias[1]"),
        ({"sampling_parameters": json.dumps({"logit_bias": {"1": -101}})}, "logit_bias[1]: a bias must be in"),
        ({"sampling_parameters": json.dumps({"logit_bias": {"50000": 1}})}, "logit_bias: 50000 is not a token id"),
    ],
)
def test_hostile_values_get_an_input_error_naming_the_field(values, message):
    with pytest.raises(InputError) as info:
        parse(text_input="x", **values)
    assert str(info.value).startswith(message), str(info.value)


def test_prompt_bytes_are_capped_before_decoding():
    get = tensors(text_input="ab" * 600)
    assert parse_request(get, CHECK, max_prompt_bytes=1200).prompt == "ab" * 600
    with pytest.raises(InputError, match=r"^text_input: 1202 bytes; the limit is 1200"):
        parse_request(tensors(text_input="ab" * 601), CHECK, max_prompt_bytes=1200)


def test_a_reader_bug_becomes_an_input_error_not_an_exception():
    def get_input(name):
        if name == "text_input":
            return np.array([[b"x"]], dtype=np.object_)
        if name == "max_tokens":
            raise MemoryError("cannot map the tensor")  # what a broken tensor could raise
        return None

    with pytest.raises(InputError, match=r"^request: could not be read \(MemoryError: cannot map the tensor\)"):
        parse_request(get_input, CHECK)


def parse_tensors(**arrays):
    return parse_request(lambda name: arrays.get(name), check=CHECK)


def text_tensor(text: str):
    return np.array([[text.encode()]], dtype=np.object_)


def test_messages_are_parsed_and_exactly_one_of_text_input_and_messages_is_required():
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    parsed = parse_tensors(messages=text_tensor(json.dumps(chat)))
    assert parsed.prompt is None
    assert parsed.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for arrays in ({}, {"text_input": text_tensor("x"), "messages": text_tensor(json.dumps(chat))}):
        with pytest.raises(InputError, match=r"^text_input, messages: send exactly one"):
            parse_tensors(**arrays)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("[{", "messages: malformed JSON"),
        ('{"role": "user"}', "messages: expected a non-empty JSON array"),
        ("[]", "messages: expected a non-empty JSON array"),
        ("[" * 3000 + "]" * 3000, "messages: JSON nested too deeply"),
        ('["hello"]', "messages[0]: expected an object"),
        ('[{"role": "bot", "content": "x"}]', "messages[0].role: expected one of system, user"),
        ('[{"content": "x"}]', "messages[0].role: expected one of"),
        ('[{"role": "user"}]', "messages[0].content: expected a string"),
        ('[{"role": "user", "content": 5}]', "messages[0].content: expected a string"),
        ('[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]', "messages[0].content: only text parts"),
        ('[{"role": "user", "content": "x", "tool_calls": []}]', "messages[0]: unknown key 'tool_calls'"),
        ('[{"role": "user", "content": "x"}, {"role": "user", "content": "y", "name": 3}]', "messages[1].name"),
    ],
)
def test_bad_messages_name_the_field(messages, message):
    with pytest.raises(InputError) as info:
        parse_tensors(messages=text_tensor(messages))
    assert str(info.value).startswith(message), str(info.value)


def test_vllm_backend_clients_sampling_parameters_are_understood():
    """Triton's vLLM backend converts string values; its sample client sends them."""
    parsed = parse(text_input="x", sampling_parameters=json.dumps({
        "temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "ignore_eos": "false", "n": 1, "best_of": None,
        "skip_special_tokens": False, "logprobs": 3, "lora_name": None, "stop": None, "seed": "7",
    }))
    params = parsed.sampling_params
    assert (params.max_tokens, params.ignore_eos, params.skip_special_tokens, params.seed) == (100, False, False, 7)
    assert params.temperature == pytest.approx(0.1) and params.top_p == pytest.approx(0.95)
    assert params.logprobs and params.top_logprobs == 3 and params.stop == []
    assert parse(text_input="x", sampling_parameters='{"logprobs": 0}').sampling_params.top_logprobs == 0
    assert not parse(text_input="x", sampling_parameters='{"logprobs": null}').sampling_params.logprobs


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"n": 17}, "n/num_return_sequences must be an integer in [1, 16]"),
        ({"n": "two"}, "sampling_parameters.n: expected a number"),
        ({"best_of": 3}, "sampling_parameters.best_of: only 1 is supported"),
        ({"include_stop_str_in_output": True}, "sampling_parameters.include_stop_str_in_output: only false"),
        ({"lora_name": "adapter"}, "lora_name: this model serves no LoRA adapters (parameter enable_lora)"),
        ({"lora_name": 3}, "sampling_parameters.lora_name: expected an adapter name"),
        ({"temperature": "warm"}, "sampling_parameters.temperature: expected a number"),
        ({"ignore_eos": "maybe"}, "sampling_parameters.ignore_eos: expected a boolean"),
        ({"logprobs": 21}, "logprobs: at most 20 top logprobs"),
    ],
)
def test_vllm_keys_we_do_not_implement_are_refused_by_name(values, message):
    with pytest.raises(InputError) as info:
        parse(text_input="x", sampling_parameters=json.dumps(values))
    assert str(info.value).startswith(message), str(info.value)


def test_openai_frontend_inputs_and_return_flags():
    """What Triton's OpenAI frontend sends a Python-backend model (its TensorRT-LLM request format)."""
    parsed = parse_tensors(
        text_input=text_tensor("x"), max_tokens=np.array([[9]], dtype=np.int32),
        seed=np.array([[5]], dtype=np.uint64), frequency_penalty=np.array([[0.5]], dtype=np.float32),
        presence_penalty=np.array([[0.25]], dtype=np.float32),
        return_num_input_tokens=np.array([[True]]), return_num_output_tokens=np.array([[True]]),
        return_cumulative_logprob=np.array([[True]]),
    )
    params = parsed.sampling_params
    assert (params.max_tokens, params.seed, params.frequency_penalty, params.presence_penalty) == (9, 5, 0.5, 0.25)
    assert parsed.returns.num_input_tokens and parsed.returns.num_output_tokens
    assert not parsed.returns.finish_reason and not parsed.returns.logprobs
    assert params.logprobs  # a cumulative logprob needs the chosen tokens' logprobs
    with pytest.raises(InputError, match=r"^seed: disagrees with random_seed"):
        parse_tensors(text_input=text_tensor("x"), seed=np.array([[5]], dtype=np.uint64),
                      random_seed=np.array([[6]], dtype=np.uint64))


def test_prompt_logprobs_key():
    def prompt_logprobs(value):
        return parse(text_input="x", sampling_parameters=json.dumps({"prompt_logprobs": value})).sampling_params.prompt_logprobs

    assert (prompt_logprobs(0), prompt_logprobs(True), prompt_logprobs(None), prompt_logprobs(False)) == (0, 0, None, None)
    assert prompt_logprobs("0") == 0
    with pytest.raises(InputError, match="prompt_logprobs: only 0"):
        prompt_logprobs(3)


def test_priority_input_and_key():
    assert parse(text_input="x", priority=3).sampling_params.priority == 3
    assert parse(text_input="x", sampling_parameters=json.dumps({"priority": -2})).sampling_params.priority == -2
    assert parse(text_input="x").sampling_params.priority == 0
    with pytest.raises(InputError, match="priority must be a 32-bit integer"):
        parse(text_input="x", sampling_parameters=json.dumps({"priority": 2**40}))


def test_kv_transfer_params_key_is_parsed_and_checked_against_the_role():
    from backend.config import KVTransferConfig  # noqa: PLC0415

    leg = {"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 5600, "transfer_token": "t" * 43}
    decode = InputProcessor(None, vocab_size=50000, max_model_len=1001,
                            kv_transfer=KVTransferConfig(kv_role="decode", kv_transfer_peers="10.0.0.5:5600"))
    parsed = parse_request(tensors(text_input="hi", sampling_parameters=json.dumps({"kv_transfer_params": leg})),
                           decode.check_sampling_params)
    assert parsed.sampling_params.kv_transfer_params.remote_port == 5600
    assert parse(text_input="hi", sampling_parameters=json.dumps({"kv_transfer_params": None})).sampling_params \
        .kv_transfer_params is None
    for params, message in ((dict(leg, remote_port=5601), "kv_transfer_params.remote_host: 10.0.0.5:5601 is not one"),
                            (dict(leg, remote_port="5600"), "sampling_parameters.kv_transfer_params.remote_port")):
        with pytest.raises(InputError, match=message):
            parse_request(tensors(text_input="hi", sampling_parameters=json.dumps({"kv_transfer_params": params})),
                          decode.check_sampling_params)
    with pytest.raises(InputError, match="this model is not a decode engine"):  # the default role: both
        parse(text_input="hi", sampling_parameters=json.dumps({"kv_transfer_params": leg}))


def test_logit_bias_key_maps_token_ids_to_biases():
    params = parse(text_input="x", sampling_parameters=json.dumps({"logit_bias": {"7": -100, "42": 2.5}})).sampling_params
    assert params.logit_bias == {7: -100.0, 42: 2.5}
    assert parse(text_input="x").sampling_params.logit_bias == {}


def test_input_ids_are_a_prompt_already_tokenized_and_exclude_the_other_prompts():
    def ids_request(ids, **values):
        arrays = {name: np.array([[value.encode() if isinstance(value, str) else value]], dtype=np.object_)
                  for name, value in values.items()}
        arrays["input_ids"] = np.array([ids])
        return parse_request(lambda name: arrays.get(name), check=CHECK)

    parsed = ids_request(np.array([5, 6, 7], dtype=np.int32))
    assert parsed.prompt_token_ids == [5, 6, 7] and parsed.prompt is None and parsed.messages is None
    for bad, message in ((np.array([5], dtype=np.int32), {"text_input": "x"}),
                         (np.array([], dtype=np.int32), {}), (np.array([1.5], dtype=np.float32), {})):
        with pytest.raises(InputError, match="input_ids"):  # named in either message
            ids_request(bad, **message)
