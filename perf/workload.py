"""Random-token workloads for the in-process benchmarks (ablations, profile_step, the
transformers peers' self-tests). Served benchmarks use client.bench's token-exact text prompts.

Token ids 0-2 are kept out (pad, BOS, EOS in the models here); every prompt starts with BOS 1.
"""

from __future__ import annotations

import random


def random_tokens(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """``num_tokens`` random ids in [3, vocab_size)."""
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """BOS then ``num_tokens - 1`` random ids in [3, vocab_size)."""
    return [1] + random_tokens(rng, num_tokens - 1, vocab_size)


def random_workload(rng: random.Random, num_requests: int, vocab_size: int, prompt_range: tuple[int, int],
                    output_range: tuple[int, int]) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) pairs with lengths uniform in the (inclusive) ranges."""
    return [(random_prompt(rng, rng.randint(*prompt_range), vocab_size), rng.randint(*output_range))
            for _ in range(num_requests)]
