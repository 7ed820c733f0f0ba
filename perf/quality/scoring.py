"""The quality evaluation's arithmetic: perplexity from per-token logprobs, the float32 transformers
reference on the same token ids, accuracy per kind, and which configurations regress.

Regression rule (the issue's): against float32, perplexity moved by more than 0.5% (relative), or
accuracy by more than 2 points.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

MAX_PERPLEXITY_CHANGE = 0.005  # relative
MAX_ACCURACY_CHANGE = 2.0  # points


def perplexity(logprobs: list[float]) -> float:
    """exp of the mean negative log-likelihood per token."""
    if not logprobs:
        raise ValueError("perplexity of no tokens")
    return math.exp(-sum(logprobs) / len(logprobs))


def reference_logprobs(model_dir: str, token_ids: list[int]) -> list[float]:
    """log P(token i + 1 | tokens 0..i) for i < len - 1, by transformers in float32 (one forward)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1).tolist()


def accuracy(answers: dict[str, str | None], items) -> dict[str, float]:
    """Percent correct overall (``all``) and per kind; a missing or failed answer counts as wrong."""
    right, total = defaultdict(int), defaultdict(int)
    for item in items:
        correct = answers.get(item.id) == item.answer
        for key in ("all", item.kind):
            total[key] += 1
            right[key] += int(correct)
    return {key: 100.0 * right[key] / total[key] for key in total}


def regressions(row: dict, baseline: dict) -> list[str]:
    """What makes ``row`` a regression against the float32 ``baseline`` (empty: none)."""
    found = []
    change = row["perplexity"] / baseline["reference_perplexity"] - 1.0
    if abs(change) > MAX_PERPLEXITY_CHANGE:
        found.append(f"perplexity {change:+.2%} against transformers float32 (limit 0.5%)")
    points = row["accuracy"]["all"] - baseline["accuracy"]["all"]
    if abs(points) > MAX_ACCURACY_CHANGE:
        found.append(f"accuracy {points:+.1f} points against {baseline['name']} (limit 2)")
    return found
