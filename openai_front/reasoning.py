"""Reasoning parsers: a reasoning model's thinking (``<think>...</think>``) apart from its answer.

vLLM's names and semantics:

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the chat template opens ``<think>`` in the prompt,
  so the output is reasoning until ``</think>`` (a ``<think>`` the model writes itself is dropped);
  an output that never closes it is all reasoning.
- ``qwen3`` (Qwen3, whose ``enable_thinking: false`` writes no think block): reasoning only when the
  output opens with ``<think>``; then as ``deepseek_r1``. Otherwise all of it is content.

``ReasoningSplitter`` does it incrementally for a stream: each delta gives the reasoning and content
it adds, and never a piece of a tag (text that may still become a tag is held until it cannot).
Concatenated, the deltas equal ``split(whole text)``.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (and so must wait)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """One choice's output, fed delta by delta: ``feed`` returns (reasoning, content) added."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser: one of {', '.join(PARSERS)}, got {parser!r}")
        self.parser = parser
        self._state = "start"  # start: nothing decided yet; reasoning; content
        self._pending = ""  # text not yet given out (it may be part of a tag)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content ``text`` adds; ``final`` gives out whatever is held."""
        self._pending += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if START.startswith(stripped) and not final:
                return "", ""  # too early to tell whether a <think> opens the output
            opened = stripped.startswith(START)
            if opened:
                self._pending = stripped[len(START):]
            self._state = "reasoning" if opened or self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = self._pending.find(END)
            if end < 0:
                keep = 0 if final else _held(self._pending, END)
                reasoning, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
                return reasoning, ""
            reasoning, self._pending = self._pending[:end], self._pending[end + len(END):]
            self._state = "content"
        content, self._pending = self._pending, ""
        return reasoning, content


def split(parser: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    return ReasoningSplitter(parser).feed(text, final=True)
