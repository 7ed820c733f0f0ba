"""Structured output's CPU mask kernel (token_bitmask.cpp) against xgrammar's own, bit for bit: random
bitmasks with all-zero, all-one and mixed words, a vocabulary that is not a multiple of 32, masks
that forbid everything but one token, and only some rows masked (the others left untouched)."""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar

from backend.structured_output.manager import apply_bitmask_cpu


@pytest.mark.parametrize("vocab_size", [49152, 49145, 32, 33, 1000])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_mask_kernel_equals_xgrammars(cpu_kernels, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    words = math.ceil(vocab_size / 32)
    num_rows = 9
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=generator)
    bitmask[:, ::3] = 0  # every token of the word forbidden
    bitmask[:, 1::4] = -1  # every token allowed
    bitmask[4] = 0
    bitmask[4, 0] = 1  # only token 0 allowed
    logits = torch.randn(num_rows, vocab_size + 5, generator=generator)[:, :vocab_size]  # a row stride > width
    expected = logits.clone()
    rows = [0, 2, 3, 4, 8]
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size, indices=rows)
    got = logits.clone() if logits.is_contiguous() else logits
    untouched = got[[1, 5, 6, 7]].clone()
    apply_bitmask_cpu(cpu_kernels, got, bitmask, rows, vocab_size)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 5, 6, 7]], untouched)
    assert torch.isfinite(got[4]).sum() == 1 and torch.isfinite(got[4, 0])
