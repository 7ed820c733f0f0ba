"""The `tokenizer` model: stateless text <-> token ids, dynamic-batched, one tokenizer call per batch.

A request carries exactly one of ``text_input`` (-> ``output_ids`` and ``num_tokens``),
``input_ids`` (-> ``text_output`` and ``num_tokens``) or ``messages`` (a JSON list of chat
messages -> ``output_ids`` and ``num_tokens`` of the prompt `llm` makes of them: the chat template
with the generation prompt, tokenized with add_special_tokens false; the OpenAI front's /tokenize
and render routes ask for it). Triton's dynamic batcher groups concurrent requests; execute()
encodes all texts and rendered chats of the batch with one ``encode_batch`` call per
add_special_tokens value and decodes all id lists with one ``decode_batch`` call (the Rust
tokenizer parallelises inside those calls). The tokenizer is the engine's: the class AutoTokenizer
picks, loaded by backend.engine.tokenizer.load_tokenizer without torch; the batch calls go to the
Rust tokenizer that class built (its pre-tokenizer, normalizer and post-processor), so the ids
equal the engine's, and chats render on the same tokenizer (backend/triton/tokenizer_chat.py). A
bad request gets an error naming the field, for that request only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backend.engine.input_processor import EngineInputError
from backend.engine.tokenizer import load_tokenizer as load_engine_tokenizer
from backend.triton.helpers import input_getter, make_error, model_parameters, set_utf8_locale
from backend.triton.inputs import GetInput, InputError, as_bool, parse_messages, scalar
from backend.triton.tokenizer_chat import ChatRenderer

# model_dir is accepted and ignored: repository tooling sets it on every model it copies.
PARAMETERS = ("tokenizer_dir", "model_dir")
REQUEST_INPUTS = ("text_input", "input_ids", "messages")


class TokenizerError(ValueError):
    """A request input is missing or bad; the message names the field."""


def tokenizer_folder(tokenizer_dir: str, base_dir: str) -> Path:
    """``tokenizer_dir``, relative to the model folder ``base_dir`` unless absolute."""
    folder = Path(tokenizer_dir)
    return folder if folder.is_absolute() else Path(base_dir) / folder


def load_tokenizer(tokenizer_dir: str, base_dir: str):
    """``tokenizer_dir``'s tokenizer (relative to the model folder) as the engine loads it: a
    transformers tokenizer whose ``backend_tokenizer`` the batch calls use."""
    folder = tokenizer_folder(tokenizer_dir, base_dir)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"parameter 'tokenizer_dir': no tokenizer.json in {folder}")
    return load_engine_tokenizer(str(folder))


def _flag(get_input: GetInput, name: str, default: bool) -> bool:
    try:
        value = scalar(get_input, name)
        return default if value is None else as_bool(name, value)
    except InputError as exc:
        raise TokenizerError(str(exc)) from None


def _text(get_input: GetInput, name: str) -> str:
    flat = np.asarray(get_input(name)).reshape(-1)
    if flat.size != 1:
        raise TokenizerError(f"{name}: expected one value, got {flat.size}")
    value = flat[0]
    try:
        return bytes(value).decode("utf-8") if isinstance(value, bytes | np.bytes_) else str(value)
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{name}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def parse_tokenizer_request(get_input: GetInput, vocab_size: int):
    """-> ("encode", text, add_special_tokens), ("decode", ids, skip_special_tokens) or ("chat", messages)."""
    sent = [name for name in REQUEST_INPUTS if get_input(name) is not None]
    if len(sent) != 1:
        named = " and ".join(sent) if sent else "text_input, input_ids or messages"
        raise TokenizerError(f"{named}: send exactly one of them")
    if sent == ["text_input"]:
        return "encode", _text(get_input, "text_input"), _flag(get_input, "add_special_tokens", True)
    if sent == ["messages"]:
        if _flag(get_input, "add_special_tokens", False):
            raise TokenizerError("add_special_tokens: only false with messages (the chat template writes the "
                                 "special tokens, as `llm` renders it)")
        try:
            return "chat", parse_messages(_text(get_input, "messages"))
        except InputError as exc:
            raise TokenizerError(str(exc)) from None
    id_list = [int(i) for i in np.asarray(get_input("input_ids")).reshape(-1)]
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


def answer_batch(getters: list[GetInput], tokenizer, vocab_size: int, chats: ChatRenderer) -> list:
    """Per request, in order: ("encode", ids), ("decode", text, number of ids) or the TokenizerError
    that refuses it alone. A chat is rendered, then encoded with the batch's other texts."""
    answers: list = [None] * len(getters)
    parsed, where = [], []
    for index, get_input in enumerate(getters):
        try:
            request = parse_tokenizer_request(get_input, vocab_size)
            if request[0] == "chat":
                request = ("encode", chats.render(request[1]), False)
        except (TokenizerError, EngineInputError) as exc:
            answers[index] = TokenizerError(str(exc))
            continue
        parsed.append(request)
        where.append(index)
    for index, request, result in zip(where, parsed, run_batch(tokenizer, parsed), strict=True):
        answers[index] = result if result[0] == "encode" else (*result, len(request[1]))
    return answers


class TritonPythonModel:
    """Triton's entry points; model_repository/tokenizer/1/model.py re-exports this class."""

    def initialize(self, args: dict) -> None:
        set_utf8_locale()
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415 (process: exists only inside Triton's stub)

        self.pb = pb_utils
        model_config = json.loads(args["model_config"])
        parameters = model_parameters(model_config)
        unknown = sorted(set(parameters) - set(PARAMETERS))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} (known: {', '.join(PARAMETERS)})")
        tokenizer_dir = parameters.get("tokenizer_dir", ".")
        tokenizer = load_tokenizer(tokenizer_dir, args["model_repository"])
        self.tokenizer = tokenizer.backend_tokenizer
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.chats = ChatRenderer(tokenizer)

    def execute(self, requests):
        getters = [input_getter(self.pb, request) for request in requests]
        return [self._response(answer) for answer in answer_batch(getters, self.tokenizer, self.vocab_size,
                                                                  self.chats)]

    def _response(self, answer):
        pb = self.pb
        if isinstance(answer, TokenizerError):
            return pb.InferenceResponse(output_tensors=[], error=make_error(pb, str(answer)))
        if answer[0] == "encode":
            ids = answer[1]
            tensors = [pb.Tensor("output_ids", np.array([ids], dtype=np.int32).reshape(1, -1)),
                       pb.Tensor("num_tokens", np.array([[len(ids)]], dtype=np.int32))]
        else:
            _, text, count = answer
            tensors = [pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                       pb.Tensor("num_tokens", np.array([[count]], dtype=np.int32))]
        return pb.InferenceResponse(output_tensors=tensors)
