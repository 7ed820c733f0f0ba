"""The dtype codes the CPU kernels take as their first argument (``dtype`` in every ``extern "C"``
entry point of this folder's C++): 0 float32, 1 bfloat16. Other dtypes take the torch paths."""

from __future__ import annotations

import torch

KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
