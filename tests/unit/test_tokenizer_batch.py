"""The `tokenizer` model's parsing and one-call-per-batch tokenizing, without a server."""

from __future__ import annotations

import numpy as np
import pytest

from backend.triton.tokenizer_model import TokenizerError, load_tokenizer, parse_tokenizer_request, run_batch


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_tokenizer(str(demo_model_dir), "/")


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
