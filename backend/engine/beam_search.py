"""Beam search for one request, step by step, with transformers' semantics (its ``_beam_search``).

``BeamSearch.step(log_probs)`` takes the log-softmax of the next-token logits of the k running
beams ([k, vocab], float32) and decides, as ``generate(num_beams=k, do_sample=False)`` does: the
2k best continuations over (beam, token) by accumulated log-probability; those that end (the EOS
token, or ``max_tokens`` reached) compete for the k finished hypotheses with their score divided
by ``generated length ** length_penalty``; the k best that do not end run on. Beams 1..k-1 start
at -1e9 so the first step draws every continuation from beam 0. It stops when no running beam
can beat the worst finished one (``early_stopping`` False: judged at the current length;
"never": at ``max_tokens`` when ``length_penalty`` > 0), when every hypothesis is finished and
``early_stopping`` is True, or when every continuation ended. The result is the best ``n``
finished hypotheses, best first. ``beam_width`` 1 is greedy.

Only tokens and scores live here; which engine requests hold which beam's KV blocks (forks,
copy-on-write, frees) is the engine's side (backend/engine/llm_engine.py, ``_beam_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEG = -1.0e9


@dataclass(slots=True)
class BeamStep:
    """What one step decided for the running beams: new beam j continues old beam ``parents[j]``
    with token ``tokens[j]``."""

    parents: list[int]
    tokens: list[int]
    done: bool


@dataclass(slots=True)
class BeamSearch:
    beam_width: int
    max_tokens: int  # generated tokens, at most
    eos_token_ids: tuple[int, ...] = ()
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never" (transformers' values)
    running: list[list[int]] = field(default_factory=list)  # generated tokens of each running beam
    running_scores: torch.Tensor | None = None  # [k] accumulated log-probabilities
    finished: list[list[int]] = field(default_factory=list)  # the k hypotheses (best first after topk)
    finished_scores: torch.Tensor | None = None  # [k]
    finished_flags: torch.Tensor | None = None  # [k] bool: a real hypothesis (not a -1e9 filler)
    improvable: bool = True
    num_generated: int = 0

    def __post_init__(self) -> None:
        k = self.beam_width
        self.running = [[] for _ in range(k)]
        self.running_scores = torch.full((k,), NEG)
        self.running_scores[0] = 0.0
        self.finished = [[] for _ in range(k)]
        self.finished_scores = torch.full((k,), NEG)
        self.finished_flags = torch.zeros(k, dtype=torch.bool)

    def step(self, log_probs: torch.Tensor) -> BeamStep:
        """log_probs: [k, vocab] float32 of the running beams (rows in beam order)."""
        k = self.beam_width
        vocab = log_probs.shape[-1]
        keep = max(2, 1 + len(self.eos_token_ids)) * k
        accumulated = (log_probs.float() + self.running_scores[:, None]).reshape(-1)
        top_values, top_indices = torch.topk(accumulated, k=keep)
        beams = (top_indices // vocab).tolist()
        tokens = (top_indices % vocab).tolist()
        candidates = [self.running[b] + [t] for b, t in zip(beams, tokens, strict=True)]
        at_limit = self.num_generated + 1 >= self.max_tokens
        hits = torch.tensor([at_limit or t in self.eos_token_ids for t in tokens])

        # the k best continuations that do not end run on
        running_values = top_values + hits.float() * NEG
        next_indices = torch.topk(running_values, k=k).indices.tolist()
        self.running = [candidates[i] for i in next_indices]
        self.running_scores = running_values[next_indices]
        parents = [beams[i] for i in next_indices]
        next_tokens = [tokens[i] for i in next_indices]

        # the finished hypotheses: the ending continuations among the first k compete with them
        scores = top_values / ((self.num_generated + 1) ** self.length_penalty)
        if bool(self.finished_flags.all()) and self.early_stopping is True:
            scores = scores + NEG
        if not self.improvable:
            scores = scores + NEG
        just_finished = hits & (torch.arange(keep) < k)
        scores = scores + (~just_finished).float() * NEG
        merged_scores = torch.cat((self.finished_scores, scores))
        merged = self.finished + candidates
        merged_flags = torch.cat((self.finished_flags, just_finished))
        best = torch.topk(merged_scores, k=k).indices.tolist()
        self.finished = [merged[i] for i in best]
        self.finished_scores = merged_scores[best]
        self.finished_flags = merged_flags[best]

        self.num_generated += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_possible = self.running_scores[0] / (best_length ** self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_possible > worst).any())
        exists_open = not (bool(self.finished_flags.all()) and self.early_stopping is True)
        valid_continuations = not bool(hits.all())
        done = not (self.improvable and exists_open and valid_continuations)
        return BeamStep(parents, next_tokens, done)

    def best(self, n: int) -> list[tuple[list[int], float]]:
        """The best ``n`` finished hypotheses with their scores, best first."""
        return [(list(self.finished[i]), float(self.finished_scores[i])) for i in range(n)]
