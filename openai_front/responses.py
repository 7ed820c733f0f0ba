"""The JSON the front answers with, in the shapes OpenAI's API (and vLLM's server) return.

Chat: ``chat.completion`` with ``message``, streamed as ``chat.completion.chunk`` with ``delta``
(the first chunk of each choice carries the role); completions: ``text_completion`` both ways.
Logprobs come from the `llm` model's vLLM-style entries (one object per token, the chosen token
first, then the request's top tokens) and are turned into OpenAI's chat form
(``content: [{token, logprob, bytes, top_logprobs}]``) or completions form (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from openai_front.reasoning import ReasoningSplitter, split

SYSTEM_FINGERPRINT = "triton-llm-serving"


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How a chat answer's reasoning is split off (openai_front/reasoning.py) and whether it is sent:
    as ``reasoning`` and ``reasoning_content`` (the older name vLLM also sends) beside ``content``."""

    parser: str | None = None  # None: no split, the whole text is content
    include: bool = True  # the request's include_reasoning

    @classmethod
    def of(cls, parsed) -> Reasoning:
        return cls(parsed.reasoning_parser, parsed.include_reasoning)  # completions have no parser

    def fields(self, reasoning: str | None) -> dict:
        return {"reasoning": reasoning, "reasoning_content": reasoning} if self.include else {}


@dataclass(slots=True)
class Choice:
    """One choice as it builds up."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # the `llm` model's entries, in order


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in a cache (prefix cache, offload tier, a prefill engine)

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _token_entry(entry: dict, top: int) -> tuple[str, float, list[tuple[str, float]]]:
    """(chosen token's text, its logprob, the top tokens (text, logprob) best first)."""
    items = list(entry.values())
    chosen = items[0]
    ranked = sorted(items, key=lambda v: -v["logprob"])[:top]
    return chosen["decoded_token"], chosen["logprob"], [(v["decoded_token"], v["logprob"]) for v in ranked]


def chat_logprobs(entries: list[dict], top: int) -> dict:
    content = []
    for entry in entries:
        token, logprob, tops = _token_entry(entry, top)
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                         for t, lp in tops]})
    return {"content": content}


def completion_logprobs(entries: list[dict], top: int, offset: int = 0) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token, logprob, tops = _token_entry(entry, top)
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(dict(tops))
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _header(request_id: str, chat: bool, model: str, created: int, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT}


def full_response(request_id: str, chat: bool, model: str, choices: list[Choice], usage: Usage,
                  top_logprobs: int | None, kv_transfer_params: dict | None = None,
                  reasoning: Reasoning = Reasoning()) -> dict:
    """``kv_transfer_params``: a prefill engine's answer, at the top level where vLLM puts it (and
    vllm-router's disaggregated mode reads it for the decode leg)."""
    body = _header(request_id, chat, model, int(time.time()), False)
    rendered = []
    for choice in sorted(choices, key=lambda c: c.index):
        logprobs = None
        if top_logprobs is not None:
            logprobs = chat_logprobs(choice.logprobs, top_logprobs) if chat else completion_logprobs(
                choice.logprobs, top_logprobs)
        if chat:
            rendered.append({"index": choice.index, "message": _message(choice.text, reasoning),
                             "logprobs": logprobs, "finish_reason": choice.finish_reason})
        else:
            rendered.append({"index": choice.index, "text": choice.text, "logprobs": logprobs,
                             "finish_reason": choice.finish_reason})
    body["choices"] = rendered
    body["usage"] = usage.body()
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def _message(text: str, reasoning: Reasoning) -> dict:
    """A chat answer's message; with a reasoning parser, its reasoning apart (None when it had none)."""
    if reasoning.parser is None:
        return {"role": "assistant", "content": text}
    thought, content = split(reasoning.parser, text)
    return {"role": "assistant", "content": content, **reasoning.fields(thought or None)}


class ChunkWriter:
    """The SSE lines of one streamed answer."""

    def __init__(self, request_id: str, chat: bool, model: str, top_logprobs: int | None,
                 reasoning: Reasoning = Reasoning()):
        self.request_id, self.chat, self.model = request_id, chat, model
        self.top_logprobs = top_logprobs
        self.reasoning = reasoning
        self._splitters: dict[int, ReasoningSplitter] = {}  # per choice, with a reasoning parser
        self.created = int(time.time())
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}

    @staticmethod
    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = _header(self.request_id, self.chat, self.model, self.created, True)
        body["choices"] = choices
        if usage is not None:
            body["usage"] = usage
        return self.event(body)

    def delta(self, index: int, text: str, finish_reason: str | None, entries: list[dict]) -> str:
        logprobs = None
        if self.top_logprobs is not None:
            if self.chat:
                logprobs = chat_logprobs(entries, self.top_logprobs)
            else:
                logprobs = completion_logprobs(entries, self.top_logprobs, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        if not self.chat:
            return self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
        lines = ""
        if index not in self._started:  # vLLM's first chunk of a choice: the role, empty content
            self._started.add(index)
            lines += self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}])
        return lines + self._chunk([{"index": index, "delta": self._chat_delta(index, text, finish_reason),
                                     "logprobs": logprobs, "finish_reason": finish_reason}])

    def _chat_delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        """The delta of a chat chunk: content, or with a reasoning parser the reasoning and the
        content this text adds (a piece that may still be part of a tag waits for the next)."""
        if self.reasoning.parser is None:
            return {"content": text} if text or finish_reason is None else {}
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.reasoning.parser))
        thought, content = splitter.feed(text, final=finish_reason is not None)
        delta = self.reasoning.fields(thought) if thought else {}
        if content or (finish_reason is None and not delta):
            delta["content"] = content
        return delta

    def usage(self, usage: Usage) -> str:
        return self._chunk([], usage.body())

    @staticmethod
    def error(body: dict) -> str:
        return ChunkWriter.event(body)

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
