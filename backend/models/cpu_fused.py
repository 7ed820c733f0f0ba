"""Fused residual add + RMSNorm and SiLU x up on the CPU (backend/attention/cpu_kernel/fused_ops.cpp).

torch runs RMSNorm as pow, mean, add, rsqrt, mul, cast, mul (bfloat16: two casts more) and the
MLP's activation as silu then mul, each a pass over memory with a temporary; the kernels do one
pass per row, with transformers' rounding order (so bfloat16 gives torch's values). The model
uses them once ``LlamaForCausalLM.use_cpu_kernels`` hands it the loaded kernels; anything they do
not take (another dtype, a non-contiguous tensor, another device) goes through torch as before.

Off unless ``LLM_CPU_FUSED_OPS=1``: measured on SmolLM2 bf16 (perf.profile_step, batch 32 decode)
they took 3.4 ms (RMSNorm) + 2.5 ms (SiLU x up) per step against about 7.3 ms for all of torch's
norm, activation and elementwise ops together, of which they replace only part, and perf.compare
saw no end-to-end gain (1.03x without them, noise). torch's ops are vectorized (bfloat16
conversion included); these loops are not, so fusing passes does not pay here.
"""

from __future__ import annotations

import os

import torch

KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def fused_ops_enabled() -> bool:
    return os.environ.get("LLM_CPU_FUSED_OPS", "0").strip().lower() in ("1", "true", "yes", "on")


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors (same CPU dtype, contiguous)."""
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
                                          for t in tensors)


def rms_norm(
    kernels,
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]; updated in place to residual + x
) -> torch.Tensor:  # [num_tokens, hidden_size]
    out = torch.empty_like(x)
    rows, hidden = x.shape
    with torch.profiler.record_function("cpu_fused_rms_norm"):
        kernels.fused_rms_norm(KERNEL_DTYPES[x.dtype], x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                               weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out


def silu_mul(
    kernels,
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]: gate | up
) -> torch.Tensor:  # [num_tokens, intermediate_size]
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype)
    with torch.profiler.record_function("cpu_fused_silu_mul"):
        kernels.fused_silu_mul(KERNEL_DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, width)
    return out
