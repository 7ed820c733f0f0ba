"""Picks the attention backend named by config.pbtxt's ``attention_backend`` parameter.

'auto' takes the CuPy kernels where they can run (a CUDA device, CuPy and NVRTC present), the CPU
paged decode and prefill kernels on the CPU where they build and take the shapes and dtype (backend/attention/
cpu_backend.py), and the torch backend everywhere else, logging why. 'cupy' and 'cpu' insist on
their kernels and fail the load with the reason when they cannot run. The CuPy module is imported
lazily: the engine imports without CuPy.
"""

from __future__ import annotations

import logging

import torch

from backend.attention.cpu_backend import CpuAttentionBackend
from backend.attention.cpu_kernel.build import KernelUnavailable, load_kernel
from backend.attention.cpu_kernel.dtypes import KERNEL_DTYPES
from backend.attention.cupy_backend import CupyAttentionBackend, cupy_available
from backend.attention.paged import PagedAttentionBackend as AttentionBackend
from backend.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKEND_NAMES = ("auto", "torch", "cupy", "cpu")

logger = logging.getLogger(__name__)


def cupy_usable(device: torch.device) -> tuple[bool, str]:
    """(True, description) when the CuPy kernels can run on ``device``, else (False, reason)."""
    if device.type != "cuda":
        return False, f"the engine runs on device '{device}', not CUDA"

    return cupy_available()


def cpu_kernel_backend(device: torch.device, head_size: int | None, dtype: torch.dtype | None,
                       group: int | None, block_size: int | None):
    """(the CPU kernel backend, None) or (None, why it cannot serve here)."""
    if device.type != "cpu":
        return None, f"the engine runs on device '{device}', not the CPU"

    if dtype is not None and dtype not in KERNEL_DTYPES:
        return None, f"the kernel takes float32 and bfloat16, not {dtype}"
    try:
        kernel = load_kernel()
    except KernelUnavailable as exc:
        return None, str(exc)
    reason = kernel.unsupported(group or 1, head_size or 1, block_size or 1)
    if reason is not None:
        return None, reason
    return CpuAttentionBackend(kernel), None


def get_attention_backend(
    name: str,
    device: torch.device | str,
    head_size: int | None = None,
    dtype: torch.dtype | None = None,
    group: int | None = None,
    block_size: int | None = None,
) -> AttentionBackend:
    """The backend for ``name`` (auto | torch | cupy | cpu) on ``device``.

    ``head_size`` and ``dtype`` let the CuPy backend compile its kernels now, at model load,
    rather than on the first forward; with ``group`` (query heads per KV head) and ``block_size``
    they tell whether the CPU kernel takes the model.
    """
    device = torch.device(device)
    if name not in ATTENTION_BACKEND_NAMES:
        raise ValueError(f"parameter 'attention_backend': unknown '{name}' (known: {', '.join(ATTENTION_BACKEND_NAMES)})")
    if name == "torch":
        return TorchAttentionBackend(device)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        backend, reason = cpu_kernel_backend(device, head_size, dtype, group, block_size)
        if backend is not None:
            return backend
        if name == "cpu":
            raise ValueError(f"parameter 'attention_backend': 'cpu' cannot run here ({reason}); use 'torch' or 'auto'")
        logger.warning("the CPU paged decode kernel is not used (%s): decodes take the torch path", reason)
        return TorchAttentionBackend(device)
    usable, reason = cupy_usable(device)
    if not usable:
        if name == "auto":
            return TorchAttentionBackend(device)
        raise ValueError(
            f"parameter 'attention_backend': 'cupy' cannot run here ({reason}); use 'torch' or 'auto'"
        )

    backend = CupyAttentionBackend(device, head_size=head_size, dtype=dtype)
    if head_size is not None and dtype is not None:
        backend.load(head_size, dtype)  # compile once, at model load
    return backend
