"""row_argmax gives torch.argmax's tokens: first index of the maximum, NaN as the maximum, any layout."""

from __future__ import annotations

import torch

from backend.runner.row_argmax import row_argmax


def test_matches_torch_on_random_rows_and_views():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen)
    assert row_argmax(logits) == logits.argmax(dim=-1).tolist()
    strided = logits[::3, 100:]  # a view: rows and columns skipped
    assert not strided.is_contiguous()
    assert row_argmax(strided) == strided.argmax(dim=-1).tolist()
    with torch.inference_mode():  # how the engine calls it
        assert row_argmax(logits * 2) == logits.argmax(dim=-1).tolist()


def test_ties_nan_and_infinities_as_torch():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0],  # a tie: the first
                           [1.0, nan, 5.0, nan],  # NaN counts as the maximum
                           [-inf, -inf, -inf, -inf],
                           [0.0, inf, 7.0, inf]])
    assert row_argmax(logits) == [1, 1, 0, 1] == logits.argmax(dim=-1).tolist()


def test_other_dtypes_and_no_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):  # bfloat16: numpy has none, torch's path
        cast = logits.to(dtype)
        assert row_argmax(cast) == cast.argmax(dim=-1).tolist()
    assert row_argmax(torch.empty(0, 300)) == []
