"""The greedy token of every row of logits, as a list.

On the CPU numpy's argmax, which is vectorised, replaces torch's: at SmolLM2's vocabulary (49152)
torch 2.13's CPU argmax takes several milliseconds for a 64-row decode step, a few percent of the
step (perf/RESULTS.md). Both return the first index of the maximum, NaN counting as the maximum.
"""

from __future__ import annotations

import torch

NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def row_argmax(logits: torch.Tensor) -> list[int]:  # logits: [rows, vocab]
    if logits.device.type == "cpu" and logits.dtype in NUMPY_DTYPES and not logits.requires_grad:
        return logits.numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=-1).tolist()
