"""Fused residual add + RMSNorm, SiLU x up, and rotary embedding + KV-cache write on the CPU
(backend/attention/cpu_kernel/fused_ops.cpp).

torch runs RMSNorm as pow, mean, add, rsqrt, mul, cast, mul (bfloat16: two casts more), the MLP's
activation as silu then mul, and the rotary embedding as an index_select, four multiplies, a sum,
a difference and a cat before two index_copy_ calls write the cache: about 30 Python dispatches a
layer, each a pass over memory with a temporary, and most on one core because a decode step's
tensors are below torch's parallel grain. The kernels do one vectorized pass per row over both
cores, with transformers' rounding order (so bfloat16 gives torch's values). The model uses them
once ``LlamaForCausalLM.use_cpu_kernels`` hands it the loaded kernels; anything they do not take
(another dtype, a non-contiguous tensor, another device) goes through torch as before.

On by default with the CPU kernels; the config.pbtxt parameter ``cpu_fused_ops: false`` turns them
off (``ModelConfig.cpu_fused_ops``; perf.compare's engine-no-fused-ops system measures that).
"""

from __future__ import annotations

import torch

from backend.attention.cpu_kernel.dtypes import KERNEL_DTYPES
from backend.attention.cpu_kernel.profiling import kernel_label



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
    with kernel_label("cpu_fused_rms_norm"):
        kernels.fused_rms_norm(KERNEL_DTYPES[x.dtype], x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                               weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out


def silu_mul(
    kernels,
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]: gate | up
) -> torch.Tensor:  # [num_tokens, intermediate_size]
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype)
    with kernel_label("cpu_fused_silu_mul"):
        kernels.fused_silu_mul(KERNEL_DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, width)
    return out


def rope_cache(
    kernels,
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size]: q | k | v
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]: cos half | sin half, qkv's dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1: not written
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [num_tokens, num_heads, head_size], k [num_tokens, num_kv_heads, head_size]
    """Rotates q and k (rotate-half RoPE at ``positions``) and writes k and v into their cache slots."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    q = torch.empty((num_tokens, num_heads, head_size), dtype=qkv.dtype)
    k = torch.empty((num_tokens, num_kv_heads, head_size), dtype=qkv.dtype)
    with kernel_label("cpu_fused_rope_cache"):
        kernels.fused_rope_cache(KERNEL_DTYPES[qkv.dtype], qkv.data_ptr(), positions.data_ptr(),
                                 cos_sin_cache.data_ptr(), q.data_ptr(), k.data_ptr(), key_cache.data_ptr(),
                                 value_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, num_heads, num_kv_heads,
                                 head_size)
    return q, k
