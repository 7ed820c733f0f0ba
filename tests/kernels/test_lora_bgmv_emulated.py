"""kernels/lora_bgmv.cu (lora_shrink, lora_expand) on the CPU emulation, launched exactly as on a GPU
(backend/lora/cuda_bgmv.py through backend/lora/slots.py), against the per-adapter torch path: the
same deltas for adapters of different ranks and targets (an untargeted part of a fused projection),
uneven rows per adapter, rows of no adapter left untouched, a strided input, slots taken over and
rewritten; in every dtype the GPU path serves."""

from __future__ import annotations

import pytest
import torch

from backend.lora.cuda_bgmv import CudaBGMV
from backend.lora.slots import LoRASlots
from tests.kernels import cases
from tests.kernels.batches import DTYPES
from tests.kernels.conftest import emulated_launch, emulated_module
from tests.unit.test_lora_slots import MAX_RANK, checked_steps, strided_input, tolerance_for

pytestmark = pytest.mark.usefixtures("emulation_built")


@pytest.mark.parametrize("dtype_name", cases.lora_dtypes())
def test_slots_through_the_cuda_kernels_equal_the_per_adapter_path(dtype_name):
    dtype = DTYPES[dtype_name]
    slots = LoRASlots(3, MAX_RANK, dtype, torch.device("cpu"))
    slots.use_cuda(CudaBGMV(dtype, emulated_module, emulated_launch))
    assert slots.has_kernel and slots.kernels is None
    for _, plan in checked_steps(slots, strided_input(dtype), tolerance_for(dtype)):
        assert plan.row_slot is not None and plan.row_slot.dtype == torch.int32
