"""One request check (issue: the reshape): the engine's, called by backend/triton before it queues
anything; each bad field is refused once, with the same message whichever way it comes in."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import EngineInputError, LLMEngine
from backend.protocol.sampling import SamplingParams
from backend.triton.inputs import InputError, parse_request
from tests.conftest import DEMO_REPOSITORY


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))


def tensor_inputs(**values):
    arrays = {"text_input": np.array([[b"a prompt"]], dtype=np.object_)}
    for name, value in values.items():
        if name == "sampling_parameters":
            arrays[name] = np.array([[json.dumps(value).encode()]], dtype=np.object_)
        elif isinstance(value, float):
            arrays[name] = np.array([[value]], dtype=np.float32)
        else:
            arrays[name] = np.array([[value]], dtype=np.int32)
    return arrays.get


CASES = [
    # (what a Triton client sends, the same request for the engine, the field the message names)
    ({"max_tokens": 0}, SamplingParams(max_tokens=0), "max_tokens"),
    ({"max_tokens": 5000}, SamplingParams(max_tokens=5000), "max_tokens"),
    ({"temperature": -0.5}, SamplingParams(temperature=-0.5), "temperature"),
    ({"top_p": 1.5}, SamplingParams(top_p=1.5), "top_p"),
    ({"top_k": -2}, SamplingParams(top_k=-2), "top_k"),
    ({"max_tokens": 4, "min_length": 9}, SamplingParams(max_tokens=4, min_tokens=9), "min_length/min_tokens"),
    ({"sampling_parameters": {"stop_token_ids": [99999999]}}, SamplingParams(stop_token_ids=[99999999]), "stop_token_ids"),
    ({"sampling_parameters": {"repetition_penalty": 0}}, SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    ({"sampling_parameters": {"min_p": 2}}, SamplingParams(min_p=2.0), "min_p"),
    ({"sampling_parameters": {"logprobs": 30}}, SamplingParams(logprobs=True, top_logprobs=30), "logprobs"),
    ({"sampling_parameters": {"stop": ["x"] * 40}}, SamplingParams(stop=["x"] * 40), "stop"),
    ({"sampling_parameters": {"logit_bias": {"99999999": 1}}}, SamplingParams(logit_bias={99999999: 1.0}),
     "logit_bias"),
    ({"sampling_parameters": {"logit_bias": {"3": 101}}}, SamplingParams(logit_bias={3: 101.0}), "logit_bias[3]"),
]


@pytest.mark.parametrize(("inputs", "params", "field"), CASES, ids=[c[2] + str(i) for i, c in enumerate(CASES)])
def test_triton_and_the_engine_refuse_a_field_with_the_same_message(engine, inputs, params, field):
    with pytest.raises(InputError) as through_triton:
        parse_request(tensor_inputs(**inputs), engine.check_sampling_params)
    with pytest.raises(EngineInputError) as through_engine:
        engine.add_request(f"r-{field}", prompt_token_ids=[1, 2, 3], sampling_params=params)
    assert str(through_triton.value) == str(through_engine.value)
    assert str(through_engine.value).startswith(field), str(through_engine.value)
    assert not engine.has_unfinished_requests()


def test_prompt_checks_happen_once_at_the_engines_door(engine):
    limit = engine.max_model_len
    cases = [
        ([], SamplingParams(max_tokens=4), "text_input: the prompt is empty"),
        ([1] * limit, SamplingParams(max_tokens=4), f"text_input: the prompt has {limit} tokens"),
        ([1] * (limit - 10), SamplingParams(max_tokens=20), "max_tokens: 20 plus the prompt's"),
    ]
    for ids, params, message in cases:
        with pytest.raises(EngineInputError, match="^" + message):
            engine.add_request("too-big", prompt_token_ids=ids, sampling_params=params)
    engine.add_request("dup", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=1))
    with pytest.raises(EngineInputError, match="request id 'dup' is already in use"):
        engine.add_request("dup", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
