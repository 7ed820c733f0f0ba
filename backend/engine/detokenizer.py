"""Incremental detokenization for streaming: token ids in, safe text deltas out.

Two layers, each holding text back for its own reason:

1. UTF-8 layer (the prefix_offset/read_offset technique of vLLM and TGI). Decoding a single new
   token alone is wrong for most tokenizers (SentencePiece drops leading spaces, byte-level BPE
   splits multibyte characters over tokens), and decoding everything each step is O(output).
   So we decode a small window ``ids[prefix_offset:]`` and emit what it adds over the already
   emitted ``ids[prefix_offset:read_offset]``. While the window decodes to text ending in U+FFFD
   (an incomplete UTF-8 character) nothing is emitted and the offsets stay put, so every emitted
   piece ends on a character boundary and the next window starts on one.
2. Stop-string layer. Text from layer 1 joins ``_pending``; the first stop string to be
   *completed* (the occurrence ending earliest; on a tie the one starting earliest) truncates the
   output before it and ends detokenization. Otherwise the longest suffix of ``_pending`` that is
   a prefix of some stop string is held back, since the next tokens may complete it; any stop
   string occurrence therefore starts inside ``_pending``, so ``_pending`` stays shorter than
   the longest stop string plus one delta.

Invariant: ``text`` is always a prefix of ``tokenizer.decode(output_ids, skip_special_tokens)``
(truncated before the first stop string), and after ``finish()`` equals it. One exception, by
design as in vLLM: the window starts with up to 5 prompt tokens as context, so a tokenizer
whose decoder strips a leading space at the start of a text (SentencePiece/Metaspace) keeps the
space the first output token carries after the prompt. For byte-level BPE the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


class IncrementalDetokenizer:
    """Per-request streaming detokenizer for HF tokenizers (``PreTrainedTokenizerFast`` et al.).

    ``update(new_token_ids)`` returns the text that is safe to emit now; ``finish()`` returns
    what was held back (never a matched stop string). ``stop_matched`` is the stop string that
    ended the output, if any; after it is set ``update()`` returns "". ``text`` is everything
    emitted so far. Decoding calls ``tokenizer.decode(ids, skip_special_tokens=...)`` on windows,
    so a tokenizer with ``clean_up_tokenization_spaces`` on may differ from a full decode where
    a cleaned-up pattern spans two windows.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.stop_matched: str | None = None
        self.text = ""

        # Token window: ids[prefix_offset:read_offset] decodes to _prefix_text, already emitted
        # (or prompt context); ids[read_offset:] is not yet emitted.
        self._ids, self._prefix_text = self._prompt_context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded text held back by the stop-string layer
        self._done = False  # stop matched or finish() called

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _prompt_context(self, prompt_ids: list[int]) -> tuple[list[int], str]:
        """The last few prompt tokens, if they decode cleanly (no U+FFFD at either end)."""
        for start in range(max(len(prompt_ids) - _PROMPT_CONTEXT_TOKENS, 0), len(prompt_ids)):
            ids = prompt_ids[start:]
            text = self._decode(ids)
            if text.endswith(_REPLACEMENT_CHAR):
                break  # the prompt ends mid-character: its context would shift the output
            if not text.startswith(_REPLACEMENT_CHAR):
                return ids, text
        return [], ""

    # ------------------------------------------------------------------ public API

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Adds this step's tokens; returns the new text that is safe to emit now."""
        if self._done:
            return ""
        self._ids.extend(new_token_ids)
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete character: wait for more tokens
        new_text = window_text[len(self._prefix_text) :]
        # The tokens just read become the next window's context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._emit(new_text, final=False)

    def finish(self) -> str:
        """Returns the held-back text at the end of the request (never a matched stop string)."""
        if self._done:
            return ""
        window_text = self._decode(self._ids[self._prefix_offset :])
        rest = window_text[len(self._prefix_text) :]
        delta = self._emit(rest, final=True)
        self._done = True
        return delta

    # ------------------------------------------------------------------ stop strings

    def _emit(self, new_text: str, final: bool) -> str:
        pending = self._pending + new_text
        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            delta = pending[:start]
            self.stop_matched = stop
            self._pending = ""
            self._done = True
        else:
            hold = 0 if final else self._hold_length(pending)
            cut = len(pending) - hold
            delta = pending[:cut]
            self._pending = pending[cut:]
        self.text += delta
        return delta

    def _find_stop(self, pending: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence ending first (then starting first), or None."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = pending.find(s)
            if start < 0:
                continue
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _hold_length(self, pending: str) -> int:
        """Length of the longest suffix of ``pending`` that is a prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        return hold
