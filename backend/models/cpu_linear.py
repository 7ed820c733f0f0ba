"""Linear layers on oneDNN-prepacked weights: the CPU fast path for every projection and lm_head.

Why: on the CPU, ``F.linear`` re-blocks the weight inside each GEMM call; a weight reordered once
at load into oneDNN's blocked layout (what torch.compile's CPU freezing does) runs the same GEMM
markedly faster (perf/RESULTS.md). The op is torch's internal
``mkldnn._linear_pointwise``, so everything here is guarded: packing happens only on the CPU, only
where the reorder succeeds and reproduces ``F.linear`` on a probe input, else layers keep
``F.linear``. The packed copy is extra memory (the plain weight stays for state_dict and tests).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

BATCH_HINT = 32  # rows the packed layout is tuned for (decode batch size; prefill is fine too)


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:  # weight: [out_features, in_features]
    """The oneDNN-packed copy of a CPU weight, or None where this torch/CPU cannot pack it."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    except (RuntimeError, AttributeError) as exc:  # e.g. bf16 without avx512bw / avx_ne_convert
        logger.info("oneDNN weight prepacking unavailable (%s): using F.linear", exc)
        return None


def packed_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    packed: torch.Tensor,  # oneDNN-packed [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe_packing(dtype: torch.dtype) -> bool:
    """Whether packed GEMMs work here and agree with F.linear (checked once per dtype)."""
    if dtype not in _PROBED:
        _PROBED[dtype] = _probe(dtype)
    return _PROBED[dtype]


_PROBED: dict[torch.dtype, bool] = {}


def _probe(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    packed = prepack_weight(weight)
    if packed is None:
        return False
    try:
        for rows in (1, 7, 33):
            x = torch.randn(rows, 40, generator=gen).to(dtype)
            with torch.inference_mode():
                got = packed_linear(x, packed, bias)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            if not torch.allclose(got.float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol * 10):
                logger.warning("oneDNN packed linear disagrees with F.linear for %s: not used", dtype)
                return False
    except RuntimeError as exc:
        logger.info("oneDNN packed linear unavailable for %s (%s)", dtype, exc)
        return False
    return True


class Linear(nn.Linear):
    """nn.Linear that runs on a prepacked weight once :meth:`prepack` succeeded, adds the running
    step's LoRA deltas to their rows when it is an adapted projection (``lora_hook``), and sums its
    output over a tensor-parallel group when it is row-parallel (``reduce``)."""

    packed_weight: torch.Tensor | None = None
    lora_hook = None  # backend/lora/step.py LoRAHook, shared by the model's projections
    lora_key: tuple[int, str] | None = None  # (layer, fused projection name)
    reduce = None  # tensor-parallel row-parallel projection: the group's all-reduce (backend/parallel/shard.py)

    def prepack(self) -> bool:
        self.packed_weight = prepack_weight(self.weight)
        return self.packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        if self.packed_weight is not None:
            out = packed_linear(x, self.packed_weight, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        hook = self.lora_hook
        if hook is not None and hook.step is not None:
            hook.step.apply(self.lora_key, x, out)
        if self.reduce is not None:  # this rank's partial sum, before the other ranks' are added
            self.reduce(out)
        return out
