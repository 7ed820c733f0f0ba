"""kernels/lora_bgmv.cu on a real GPU through CuPy (backend/lora/cuda_bgmv.py), against the
per-adapter torch path on the same device: the layouts of tests/unit/test_lora_slots.py (mixed
adapters, uneven rows, an untargeted part, slots taken over and rewritten)."""

from __future__ import annotations

import pytest
import torch

from backend.lora.cuda_bgmv import CudaBGMV
from backend.lora.slots import LoRASlots
from tests.unit.test_lora_slots import MAX_RANK, checked_steps, strided_input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_lora_kernels_equal_the_per_adapter_path(dtype):
    device = torch.device("cuda")
    slots = LoRASlots(3, MAX_RANK, dtype, device)
    slots.use_cuda(CudaBGMV(dtype))
    tolerance = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}
    for _, plan in checked_steps(slots, strided_input(dtype, device), tolerance):
        assert plan.row_slot is not None and plan.row_slot.device.type == "cuda"
