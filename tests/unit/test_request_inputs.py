"""Parsing of the `llm` model's input tensors: every bad input names its field."""

from __future__ import annotations

import json

import numpy as np
import pytest

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


def parse(**values):
    return parse_request(tensors(**values), default_max_tokens=32, max_tokens_limit=1000)


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
    ],
)
def test_hostile_values_get_an_input_error_naming_the_field(values, message):
    with pytest.raises(InputError) as info:
        parse(text_input="x", **values)
    assert str(info.value).startswith(message), str(info.value)


def test_prompt_bytes_are_capped_before_decoding():
    get = tensors(text_input="ab" * 600)
    assert parse_request(get, 32, 1000, max_prompt_bytes=1200).prompt == "ab" * 600
    with pytest.raises(InputError, match=r"^text_input: the prompt is 1202 bytes; the limit is 1200"):
        parse_request(tensors(text_input="ab" * 601), 32, 1000, max_prompt_bytes=1200)


def test_a_reader_bug_becomes_an_input_error_not_an_exception():
    def get_input(name):
        if name == "text_input":
            return np.array([[b"x"]], dtype=np.object_)
        if name == "max_tokens":
            raise MemoryError("cannot map the tensor")  # what a broken tensor could raise
        return None

    with pytest.raises(InputError, match=r"^request: could not be read \(MemoryError: cannot map the tensor\)"):
        parse_request(get_input, 32, 1000)
