"""Verifying proposed tokens against the target model's distributions, exactly.

A request that proposed ``d_1..d_k`` gets ``k + 1`` rows of target logits from the step's forward:
row i is the target's distribution for the token after ``d_1..d_i`` (row 0: after the known tokens).

- Greedy: accept the longest prefix of proposals equal to the row-wise argmax, then take the
  argmax of the first row that disagreed (or of row k when all agreed: the bonus token). The output
  is the greedy output without speculation, token for token.
- Sampled (rejection sampling, Leviathan et al. 2023 / Chen et al. 2023): proposal ``d_i`` drawn from
  a draft distribution ``q_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
  first rejection the token is drawn from the normalised residual ``max(0, p_i - q_i)``; when all are
  accepted the bonus token is drawn from ``p_k``. Each emitted token is then distributed exactly as
  the target's ``p`` given the tokens before it. Prompt lookup proposes without a distribution: ``q``
  is a point mass at ``d_i``, so acceptance is ``p_i(d_i)`` and the residual is ``p_i`` without ``d_i``.

- Seeded sampled requests (``verify_seeded``): the token of each position is the winner of the
  exponential race over ``p`` with that position's own vocabulary-sized draw, taken from the
  request's generator in position order, exactly as backend/runner/sampler.py draws one row per token;
  proposals are accepted while they equal the winner. Each token is an exact draw from ``p`` (for
  a point-mass proposal the acceptance probability is ``p(d)``, as with rejection sampling), and
  a seed gives the same tokens with speculation or without, however many steps speculated.

Random numbers (rejection sampling): every verification draws exactly ``k`` uniforms and one vocabulary-sized uniform
row from the request's generator, whatever is accepted, so a seeded request's draws depend only on
its own tokens (the token itself is taken by the exponential race ``argmax(dist / -log U)``, as in
backend/runner/sampler.py).
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], proposals: list[int]) -> list[int]:
    """The tokens to append: the agreeing proposals and one token of the target's. len(argmax) = k + 1."""
    tokens = []
    for index, proposed in enumerate(proposals):
        if proposed != target_argmax[index]:
            tokens.append(target_argmax[index])
            return tokens
        tokens.append(proposed)
    tokens.append(target_argmax[len(proposals)])
    return tokens


def rejection_sample(
    target_probs: torch.Tensor,  # [k + 1, vocab] float32, each row sums to 1 (processed: temperature, top-k/p)
    proposals: list[int],  # k proposed token ids
    draft_probs: torch.Tensor | None,  # [k, vocab] the distributions they were drawn from; None: point masses
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """(tokens to append, number of proposals accepted). See the module docstring."""
    k = len(proposals)
    device = target_probs.device
    uniforms = torch.rand(k, generator=generator, device=device, dtype=torch.float32) if k else None
    noise = torch.empty(target_probs.shape[1], dtype=torch.float32, device=device)
    noise.uniform_(generator=generator)
    exponential = noise.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()  # Exponential(1), > 0
    if k:
        index = torch.arange(k, device=device)
        chosen = torch.tensor(proposals, dtype=torch.long, device=device)
        p = target_probs[index, chosen]  # [k]
        q = draft_probs[index, chosen] if draft_probs is not None else torch.ones_like(p)
        accept = (uniforms * q <= p).tolist()  # u < p / q without dividing by a zero q
    else:
        accept = []
    tokens: list[int] = []
    for i, proposed in enumerate(proposals):
        if accept[i]:
            tokens.append(proposed)
            continue
        if draft_probs is not None:
            residual = (target_probs[i] - draft_probs[i]).clamp_(min=0.0)
        else:
            residual = target_probs[i].clone()
            residual[proposed] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q (rounding): any draw from p is exact
            residual = target_probs[i]
        tokens.append(int((residual / exponential).argmax()))
        return tokens, i
    tokens.append(int((target_probs[k] / exponential).argmax()))
    return tokens, k


def race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """argmax(probs / -log U) with one vocabulary-sized U: a draw from probs [vocab]."""
    noise = torch.empty(probs.shape[0], dtype=torch.float32, device=probs.device).uniform_(generator=generator)
    return int((probs / noise.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()).argmax())


def verify_seeded(
    target_probs: torch.Tensor,  # [k + 1, vocab] float32 processed target distributions
    proposals: list[int],
    generator: torch.Generator,  # the request's own (seeded) generator
) -> tuple[list[int], int]:
    """(tokens to append, proposals accepted): one race per emitted token, in position order."""
    tokens: list[int] = []
    for i, proposed in enumerate(proposals):
        token = race(target_probs[i], generator)
        tokens.append(token)
        if token != proposed:
            return tokens, i
    tokens.append(race(target_probs[len(proposals)], generator))
    return tokens, len(proposals)
