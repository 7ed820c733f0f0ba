"""The decode rows' LoRA deltas on NVIDIA GPUs: kernels/lora_bgmv.cu (shrink, then expand, over the
adapter slots of backend/lora/slots.py) launched through CuPy, as the attention kernels are.

Tests without a GPU pass the CPU emulation's ``module_factory`` and ``launch`` (kernels/emulation):
the same argument packing and launch shapes then run on CPU tensors.
"""

from __future__ import annotations

import torch

from backend.attention.cupy_backend import DTYPE_NAMES, cupy_launch, cupy_module
from backend.models.shape import ceil_div
from kernels.build_options import LORA_THREADS, lora_bgmv_spec
from kernels.launch_args import lora_expand_args, lora_shrink_args


class CudaBGMV:
    def __init__(self, dtype: torch.dtype, module_factory=None, launch=None) -> None:
        module = (module_factory or cupy_module)(lora_bgmv_spec(DTYPE_NAMES[dtype]))
        self.shrink = module.get_function("lora_shrink")
        self.expand = module.get_function("lora_expand")
        self.launch = launch or cupy_launch

    def apply(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        out: torch.Tensor,  # [num_tokens, out_features], updated in place
        row_slot: torch.Tensor,  # [rows] int32, on x's device: each of the first rows' slot (-1: none)
        a: torch.Tensor,  # [slots, parts x rank, in_features]
        bt: torch.Tensor,  # [slots, rank, out_features]
        part_columns: tuple[int, ...],
    ) -> None:
        rows = row_slot.shape[0]
        shrunk = torch.empty(rows, a.shape[1], dtype=torch.float32, device=x.device)
        self.launch(self.shrink, (rows,), (LORA_THREADS,), lora_shrink_args(x, a, row_slot, shrunk))
        self.launch(self.expand, (rows, ceil_div(out.shape[1], LORA_THREADS)), (LORA_THREADS,),
                    lora_expand_args(shrunk, bt, row_slot, out, part_columns))
