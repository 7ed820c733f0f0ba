"""Prompt-lookup proposals (n-gram matching, as vLLM's ``ngram`` method and transformers'
``prompt_lookup_num_tokens``): find the request's last few tokens earlier in its prompt and output,
and propose the tokens that followed them there.

Copying work (summaries that quote, code edits, a passage repeated) makes those continuations
right often; free text rarely matches at all, and then nothing is proposed, which costs nothing.
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A request's token ids as a growing numpy array (appended, never rebuilt per step)."""

    __slots__ = ("array", "length")

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The first len(token_ids) ids as an array view; only the new ones are copied in."""
        n = len(token_ids)
        if n < self.length:  # cannot happen for a request (tokens only grow): start over
            self.length = 0
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length : n] = token_ids[self.length : n]
            self.length = n
        return self.array[:n]


def propose_by_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the longest earlier match of the last ``min_n..max_n`` tokens.

    tokens: [n] int64. Among matches of the longest length the most recent one whose continuation
    has all ``k`` tokens wins (else the one with the longest continuation). [] without a match.
    Work is proportional to the occurrences of the last token, not to n x max_n.
    """
    n = int(tokens.shape[0])
    if n < min_n + 1 or k < 1:
        return []
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])  # earlier positions holding the last token
    if ends.size == 0:
        return []
    lengths = np.ones(ends.size, dtype=np.int64)  # match length ending at each candidate
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        if n - 1 - back < 0:
            break
        positions = ends - back
        still = alive & (positions >= 0)
        still[still] = tokens[positions[still]] == tokens[n - 1 - back]
        if not still.any():
            break
        lengths += still
        alive = still
    best = int(lengths.max())
    if best < min_n:
        return []
    candidates = ends[lengths == best]
    continuation = np.minimum(n - 1 - candidates, k)  # tokens after each match end
    pick = candidates[np.flatnonzero(continuation == continuation.max())[-1]]
    start = int(pick) + 1
    return tokens[start : start + min(k, n - start)].tolist()


class NgramProposer:
    """Proposes by prompt lookup for each request; keeps each request's token array between steps."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._histories: dict[str, TokenHistory] = {}

    def propose(self, request, k: int) -> list[int]:
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = TokenHistory()
        return propose_by_lookup(history.sync(request.all_token_ids), self.min_n, self.max_n, k)

    def release(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def keep_only(self, request_ids) -> None:
        """Forgets requests no longer running (they ended, or wait after a preemption)."""
        for request_id in [r for r in self._histories if r not in request_ids]:
            del self._histories[request_id]
