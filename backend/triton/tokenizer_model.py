"""The `tokenizer` model: stateless text <-> token ids, dynamic-batched, one tokenizer call per batch.

A request carries either ``text_input`` (-> ``output_ids`` and ``num_tokens``) or ``input_ids``
(-> ``text_output`` and ``num_tokens``). Triton's dynamic batcher groups concurrent requests;
execute() encodes all texts of the batch with one ``encode_batch`` call and decodes all id lists
with one ``decode_batch`` call (the Rust tokenizer parallelises inside those calls). It loads the
`tokenizers` library only (milliseconds), not transformers, so it costs nothing next to the LLMs;
its ids equal the engine's (both read the same tokenizer.json with its post-processor).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.triton.helpers import input_getter, make_error, model_parameters, set_utf8_locale
from backend.triton.inputs import InputError, as_bool, scalar

# model_dir is accepted and ignored: repository tooling sets it on every model it copies.
PARAMETERS = ("tokenizer_dir", "model_dir")


class TokenizerError(ValueError):
    """A request input is missing or bad; the message names the field."""


def load_tokenizer(tokenizer_dir: str, base_dir: str):
    """The fast tokenizer from ``tokenizer_dir/tokenizer.json`` (relative to the model folder)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    folder = Path(tokenizer_dir)
    if not folder.is_absolute():
        folder = Path(base_dir) / folder
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"parameter 'tokenizer_dir': no tokenizer.json in {folder}")
    return Tokenizer.from_file(str(path))


def _flag(get_input, name: str, default: bool) -> bool:
    try:
        value = scalar(get_input, name)
        return default if value is None else as_bool(name, value)
    except InputError as exc:
        raise TokenizerError(str(exc)) from None


def parse_tokenizer_request(get_input, vocab_size: int):
    """-> ("encode", text, add_special_tokens) or ("decode", ids, skip_special_tokens)."""
    text = get_input("text_input")
    ids = get_input("input_ids")
    if (text is None) == (ids is None):
        raise TokenizerError("text_input or input_ids: send exactly one of them")
    if text is not None:
        flat = np.asarray(text).reshape(-1)
        if flat.size != 1:
            raise TokenizerError(f"text_input: expected one value, got {flat.size}")
        value = flat[0]
        try:
            value = bytes(value).decode("utf-8") if isinstance(value, bytes | np.bytes_) else str(value)
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"text_input: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        return "encode", value, _flag(get_input, "add_special_tokens", True)
    id_list = [int(i) for i in np.asarray(ids).reshape(-1)]
    if any(not 0 <= i < vocab_size for i in id_list):
        raise TokenizerError(f"input_ids: ids must be in [0, {vocab_size})")
    return "decode", id_list, _flag(get_input, "skip_special_tokens", True)


def run_batch(tokenizer, parsed: list[tuple]) -> list[tuple]:
    """Per request: ("encode", ids) or ("decode", text); at most one encode and one decode call."""
    results: list[tuple | None] = [None] * len(parsed)
    for kind, flag in (("encode", True), ("encode", False), ("decode", True), ("decode", False)):
        indices = [i for i, p in enumerate(parsed) if p[0] == kind and p[2] == flag]
        if not indices:
            continue
        if kind == "encode":
            encodings = tokenizer.encode_batch([parsed[i][1] for i in indices], add_special_tokens=flag)
            for i, encoding in zip(indices, encodings, strict=True):
                results[i] = ("encode", list(encoding.ids))
        else:
            texts = tokenizer.decode_batch([parsed[i][1] for i in indices], skip_special_tokens=flag)
            for i, text in zip(indices, texts, strict=True):
                results[i] = ("decode", text)
    return results


class TritonPythonModel:
    """Triton's entry points; model_repository/tokenizer/1/model.py re-exports this class."""

    def initialize(self, args: dict) -> None:
        set_utf8_locale()
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 (only inside the stub)

        self.pb = pb_utils
        model_config = json.loads(args["model_config"])
        parameters = model_parameters(model_config)
        unknown = sorted(set(parameters) - set(PARAMETERS))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} (known: {', '.join(PARAMETERS)})")
        self.tokenizer = load_tokenizer(parameters.get("tokenizer_dir", "."), args["model_repository"])
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def execute(self, requests):
        pb = self.pb
        responses: list = [None] * len(requests)
        parsed, where = [], []
        for index, request in enumerate(requests):
            try:
                parsed.append(parse_tokenizer_request(input_getter(pb, request), self.vocab_size))
                where.append(index)
            except TokenizerError as exc:
                responses[index] = pb.InferenceResponse(output_tensors=[], error=make_error(pb, str(exc)))
        for position, (kind, value) in enumerate(run_batch(self.tokenizer, parsed)):
            index = where[position]
            if kind == "encode":
                tensors = [pb.Tensor("output_ids", np.array([value], dtype=np.int32).reshape(1, -1)),
                           pb.Tensor("num_tokens", np.array([[len(value)]], dtype=np.int32))]
            else:
                tensors = [pb.Tensor("text_output", np.array([[value.encode("utf-8")]], dtype=np.object_)),
                           pb.Tensor("num_tokens", np.array([[len(parsed[position][1])]], dtype=np.int32))]
            responses[index] = pb.InferenceResponse(output_tensors=tensors)
        return responses
