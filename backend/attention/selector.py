"""Picks the attention backend named by config.pbtxt's ``attention_backend`` parameter.

'auto' takes the CuPy kernels where they can run (a CUDA device, CuPy and NVRTC present) and the
torch backend everywhere else. 'cupy' insists on the kernels and fails the load with the reason
when they cannot run. The CuPy module is imported lazily: the engine imports without CuPy.
"""

from __future__ import annotations

import torch

from backend.attention.paged import PagedAttentionBackend as AttentionBackend
from backend.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKEND_NAMES = ("auto", "torch", "cupy")


def cupy_usable(device: torch.device) -> tuple[bool, str]:
    """(True, description) when the CuPy kernels can run on ``device``, else (False, reason)."""
    if device.type != "cuda":
        return False, f"the engine runs on device '{device}', not CUDA"
    from backend.attention.cupy_backend import cupy_available  # noqa: PLC0415 (imports no CuPy itself)

    return cupy_available()


def get_attention_backend(
    name: str,
    device: torch.device | str,
    head_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend for ``name`` (auto | torch | cupy) on ``device``.

    ``head_size`` and ``dtype`` let the CuPy backend compile its kernels now, at model load,
    rather than on the first forward.
    """
    device = torch.device(device)
    if name not in ATTENTION_BACKEND_NAMES:
        raise ValueError(f"parameter 'attention_backend': unknown '{name}' (known: {', '.join(ATTENTION_BACKEND_NAMES)})")
    if name == "torch":
        return TorchAttentionBackend(device)
    usable, reason = cupy_usable(device)
    if not usable:
        if name == "auto":
            return TorchAttentionBackend(device)
        raise ValueError(
            f"parameter 'attention_backend': 'cupy' cannot run here ({reason}); use 'torch' or 'auto'"
        )
    from backend.attention.cupy_backend import CupyAttentionBackend  # noqa: PLC0415

    backend = CupyAttentionBackend(device, head_size=head_size, dtype=dtype)
    if head_size is not None and dtype is not None:
        backend.load(head_size, dtype)  # compile once, at model load
    return backend
