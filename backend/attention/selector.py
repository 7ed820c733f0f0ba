"""Picks the attention backend named by config.pbtxt's ``attention_backend`` parameter.

'auto' and 'torch' give the torch backend (it runs everywhere). 'cupy' imports the CuPy kernel
backend lazily, so the engine imports without CuPy; a missing CuPy or GPU fails with a clear
message instead of a bare ImportError deep in a layer.
"""

from __future__ import annotations

import torch

from backend.attention.base import AttentionBackend
from backend.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKEND_NAMES = ("auto", "torch", "cupy")


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Returns the backend for ``name`` (auto | torch | cupy) on ``device``."""
    device = torch.device(device)
    if name in ("auto", "torch"):
        return TorchAttentionBackend(device)
    if name == "cupy":
        if device.type != "cuda":
            raise ValueError(f"attention_backend 'cupy' needs a CUDA device, got device '{device}'")
        try:
            from backend.attention.cupy_backend import CupyAttentionBackend
        except ImportError as exc:
            raise RuntimeError(
                f"attention_backend 'cupy' is unavailable: {exc}. Install cupy-cuda12x on a CUDA "
                "machine, or set attention_backend to 'torch'."
            ) from exc
        return CupyAttentionBackend(device)
    raise ValueError(f"unknown attention_backend '{name}' (known: {', '.join(ATTENTION_BACKEND_NAMES)})")
