"""The gated MLPs' activation by its config name (``family.ACTIVATIONS``): SiLU (Llama, Qwen, Mistral,
Phi, the MoE experts) or the tanh GELU (Gemma). The dense MLP and the sparse experts share it."""

from __future__ import annotations

import torch.nn.functional as F


def activation_fn(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu
