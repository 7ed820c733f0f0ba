"""The `tokenizer` model's parsing, one-call-per-batch tokenizing and chat rendering, without a server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.engine.input_processor import InputProcessor
from backend.engine.tokenizer import load_tokenizer as load_llm_tokenizer
from backend.triton.inputs import parse_messages
from backend.triton.tokenizer_chat import ChatRenderer
from backend.triton.tokenizer_model import (
    TokenizerError,
    answer_batch,
    load_tokenizer,
    parse_tokenizer_request,
    run_batch,
)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_tokenizer(str(demo_model_dir), "/").backend_tokenizer


def getter(**inputs):
    return lambda name: inputs.get(name)


def test_parse_picks_the_direction_and_checks_inputs():
    text = np.array([["héllo".encode()]], dtype=np.object_)
    assert parse_tokenizer_request(getter(text_input=text), 100) == ("encode", "héllo", True)
    ids = np.array([[1, 2, 3]], dtype=np.int32)
    flag = np.array([[False]])
    assert parse_tokenizer_request(getter(input_ids=ids, skip_special_tokens=flag), 100) == ("decode", [1, 2, 3], False)
    for inputs in ({}, {"text_input": text, "input_ids": ids}):
        with pytest.raises(TokenizerError, match="exactly one"):
            parse_tokenizer_request(getter(**inputs), 100)
    with pytest.raises(TokenizerError, match="input_ids"):
        parse_tokenizer_request(getter(input_ids=np.array([[5, 100]])), 100)
    with pytest.raises(TokenizerError, match="UTF-8"):
        parse_tokenizer_request(getter(text_input=np.array([[b"\xff"]], dtype=np.object_)), 100)


def test_one_call_per_kind_and_order_kept(tokenizer):
    calls = []

    class Counting:
        def encode_batch(self, texts, add_special_tokens):
            calls.append(("encode", len(texts)))
            return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

        def decode_batch(self, ids, skip_special_tokens):
            calls.append(("decode", len(ids)))
            return tokenizer.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    hello = tokenizer.encode("hello world").ids
    parsed = [("encode", "hello world", True), ("decode", hello, True), ("encode", "東京", True),
              ("encode", "hello world", False)]
    results = run_batch(Counting(), parsed)
    assert calls == [("encode", 2), ("encode", 1), ("decode", 1)]
    assert results[0] == ("encode", hello) and hello[0] == 1
    assert results[1] == ("decode", "hello world")
    assert results[2] == ("encode", tokenizer.encode("東京").ids)
    assert results[3] == ("encode", hello[1:])


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from backend.models.smollm2_model import build

    return str(build())  # made by make setup; a no-op then


def text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"}]


def test_messages_get_the_ids_llm_computes_for_them(smollm2_dir):
    loaded = load_tokenizer(smollm2_dir, "/")
    fast = loaded.backend_tokenizer
    answers = answer_batch([getter(messages=text(json.dumps(CHAT)))], fast, fast.get_vocab_size(True),
                           ChatRenderer(loaded))
    llm_tokenizer = load_llm_tokenizer(smollm2_dir)
    inputs = InputProcessor(llm_tokenizer, len(llm_tokenizer), 8192)
    expected = inputs.tokenize(inputs.render_chat(parse_messages(json.dumps(CHAT))), add_special_tokens=False)
    assert answers == [("encode", expected)]
    assert fast.decode(expected, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_a_mixed_batch_is_answered_per_request_with_one_call_per_kind(smollm2_dir):
    loaded = load_tokenizer(smollm2_dir, "/")
    fast = loaded.backend_tokenizer
    calls = []

    class Counting:
        def encode_batch(self, texts, add_special_tokens):
            calls.append(("encode", add_special_tokens, len(texts)))
            return fast.encode_batch(texts, add_special_tokens=add_special_tokens)

        def decode_batch(self, ids, skip_special_tokens):
            calls.append(("decode", skip_special_tokens, len(ids)))
            return fast.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    chats = ChatRenderer(loaded)
    hello = fast.encode("hello world").ids
    one_chat = [CHAT[-1]]
    getters = [getter(text_input=text("hello world")), getter(messages=text(json.dumps(CHAT))),
               getter(input_ids=np.array([hello], dtype=np.int32)), getter(messages=text("[{\"role\": ")),
               getter(messages=text(json.dumps(one_chat))), getter(messages=text(json.dumps({"role": "user"}))),
               getter(text_input=text("hi"), messages=text(json.dumps(CHAT))),
               getter(messages=text(json.dumps(one_chat)), add_special_tokens=np.array([[True]]))]
    answers = answer_batch(getters, Counting(), fast.get_vocab_size(True), chats)
    assert calls == [("encode", True, 1), ("encode", False, 2), ("decode", True, 1)]
    assert answers[0] == ("encode", hello)
    assert answers[1] == ("encode", fast.encode(chats.render(parse_messages(json.dumps(CHAT))),
                                                add_special_tokens=False).ids)
    assert answers[2] == ("decode", "hello world", len(hello))
    assert answers[4] == ("encode", fast.encode(chats.render(one_chat), add_special_tokens=False).ids)
    errors = {index: str(answers[index]) for index in (3, 5, 6, 7)}
    assert all(isinstance(answers[index], TokenizerError) for index in errors)
    assert errors[3].startswith("messages: malformed JSON")
    assert errors[5].startswith("messages: expected a non-empty JSON array")
    assert errors[6] == "text_input and messages: send exactly one of them"
    assert errors[7].startswith("add_special_tokens: only false with messages")


def test_messages_for_a_model_without_a_chat_template_error_alone(tokenizer, demo_model_dir):
    answers = answer_batch([getter(messages=text(json.dumps(CHAT))), getter(text_input=text("hello world"))],
                           tokenizer, tokenizer.get_vocab_size(True), ChatRenderer(load_llm_tokenizer(str(demo_model_dir))))
    assert isinstance(answers[0], TokenizerError) and str(answers[0]).startswith("messages: this model has no chat template")
    assert answers[1] == ("encode", tokenizer.encode("hello world").ids)


def test_a_folder_without_tokenizer_json_fails_the_load_naming_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="parameter 'tokenizer_dir': no tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing"), "/")
