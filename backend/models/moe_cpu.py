"""A sparse MLP's experts through one CPU kernel call (backend/attention/cpu_kernel/moe_experts.cpp).

Why: the torch path runs a oneDNN GEMM pair per expert with work plus an activation, a multiply, a
scale and an ``index_add_``, each a Python dispatch, on a handful of rows per expert; a decode step
of a mixture of experts is bound by reading every expert's weights, and the kernel reads each
weight block once for all of its expert's rows, spreading all experts' blocks over the threads at
once. The weights are repacked once at load into the kernel's blocked layout, which replaces the
oneDNN-packed copy (the plain parameters stay, as for every projection).

Taken for SiLU experts in float32 or bfloat16 on the CPU kernels (``use_cpu_kernels``). In float32,
and in bfloat16 where the library multiplies by ``vdpbf16ps`` (AVX512_BF16: weights packed in depth
pairs), it serves every step, within about 10% of oneDNN's GEMMs even for 2,048-token prefills and
faster below 512 tokens, so the oneDNN-packed expert copies are dropped. Without AVX512_BF16 the
bfloat16 kernel multiplies in float32 and oneDNN wins from about 50 tokens a step, so it takes steps
of at most ``BF16_MAX_TOKENS`` tokens and both copies are kept (perf/RESULTS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.attention.cpu_kernel.dtypes import KERNEL_DTYPES
from backend.attention.cpu_kernel.profiling import kernel_label
from backend.models import cpu_fused
from backend.models.shape import ceil_div

BLOCK = 64  # packed columns per weight block (moe_experts.cpp's kBlock)
HALF = 32  # intermediate columns per gate_up block: 32 gate, then the same 32 up
BF16_MAX_TOKENS = 48  # without AVX512_BF16, bfloat16 steps with more tokens run oneDNN's GEMMs (see above)


def pack_gate_up(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """[E, 2 * I, H] (gate rows, then up rows) -> [E, I_pad / 32, H, 64], or in depth pairs."""
    experts, double, hidden = weight.shape
    inter = double // 2
    padded = ceil_div(inter, HALF) * HALF
    gate = F.pad(weight[:, :inter], (0, 0, 0, padded - inter)).view(experts, padded // HALF, HALF, hidden)
    up = F.pad(weight[:, inter:], (0, 0, 0, padded - inter)).view(experts, padded // HALF, HALF, hidden)
    packed = torch.cat([gate, up], dim=2).transpose(2, 3)
    return in_depth_pairs(packed) if pairs else packed.contiguous()


def pack_down(weight: torch.Tensor, inter_padded: int, pairs: bool = False) -> torch.Tensor:
    """[E, H, I] -> [E, H_pad / 64, I_pad, 64], or in depth pairs."""
    experts, hidden, inter = weight.shape
    padded = ceil_div(hidden, BLOCK) * BLOCK
    full = F.pad(weight, (0, inter_padded - inter, 0, padded - hidden))  # [E, H_pad, I_pad]
    packed = full.view(experts, padded // BLOCK, BLOCK, inter_padded).transpose(2, 3)
    return in_depth_pairs(packed) if pairs else packed.contiguous()


def in_depth_pairs(packed: torch.Tensor) -> torch.Tensor:  # [..., depth, 64] -> [..., ceil(depth / 2), 64, 2]
    """Two consecutive depths of each column side by side: vdpbf16ps's operand layout."""
    padded = F.pad(packed, (0, 0, 0, packed.shape[-2] % 2))  # an odd depth gets a zero row
    return padded.unflatten(-2, (-1, 2)).transpose(-1, -2).contiguous()


class CpuExperts:
    """Callable: (x [num_tokens, hidden], router weights [num_tokens, top_k], expert ids
    [num_tokens, top_k] int64) -> [num_tokens, hidden], the experts' weighted sum per token."""

    def __init__(self, kernels, gate_up: torch.Tensor, down: torch.Tensor):  # [E, 2I, H], [E, H, I]
        self.kernels = kernels
        self.num_experts, _, self.hidden = gate_up.shape
        self.dtype = gate_up.dtype
        pairs = self.dtype == torch.bfloat16 and bool(kernels.moe_experts_bf16_pairs())  # the library's layout
        self.gate_up = pack_gate_up(gate_up.detach(), pairs)
        self.inter_padded = self.gate_up.shape[1] * HALF
        self.down = pack_down(down.detach(), self.inter_padded, pairs)
        self.max_tokens = BF16_MAX_TOKENS if self.dtype == torch.bfloat16 and not pairs else None  # None: every step

    @staticmethod
    def serves(weight: torch.Tensor, activation: str) -> bool:
        """Whether the kernel computes these experts (a CPU dtype it takes, the SiLU gate)."""
        return cpu_fused.takes(weight) and activation == "silu"

    def takes(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.device.type == "cpu" and x.stride(1) == 1 and x.shape[0] > 0
                and (self.max_tokens is None or x.shape[0] <= self.max_tokens))

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size], rows may be strided
        weights: torch.Tensor,  # [num_tokens, top_k], any float dtype
        experts: torch.Tensor,  # [num_tokens, top_k] int64, distinct per token
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens, top_k = experts.shape
        ids = experts.contiguous()
        scales = weights.to(torch.float32).contiguous()
        out = torch.empty((num_tokens, self.hidden), dtype=self.dtype)
        with kernel_label("cpu_moe_experts"):
            self.kernels.moe_experts(KERNEL_DTYPES[self.dtype], x.data_ptr(), x.stride(0), num_tokens, self.hidden,
                                     self.gate_up.data_ptr(), self.down.data_ptr(), self.inter_padded,
                                     self.num_experts, top_k, ids.data_ptr(), scales.data_ptr(), out.data_ptr())
        return out
