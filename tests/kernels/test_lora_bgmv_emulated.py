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
from backend.lora.step import LoRAStep
from tests.kernels import cases
from tests.kernels.batches import DTYPES
from tests.kernels.conftest import emulated_launch, emulated_module
from tests.unit.test_lora_slots import IN, MAX_RANK, adapter, cast, deltas

pytestmark = pytest.mark.usefixtures("emulation_built")


@pytest.mark.parametrize("dtype_name", cases.lora_dtypes())
def test_slots_through_the_cuda_kernels_equal_the_per_adapter_path(dtype_name):
    dtype = DTYPES[dtype_name]
    keys = [(0, "o_proj"), (0, "gate_up_proj"), (1, "qkv_proj"), (1, "down_proj")]
    a = adapter("a", 8, keys, 1)
    b = adapter("b", 4, keys[:3], 2, skip_part=1)
    c = adapter("c", 2, keys[2:], 3)
    slots = LoRASlots(3, MAX_RANK, dtype, torch.device("cpu"))
    slots.use_cuda(CudaBGMV(dtype, emulated_module, emulated_launch))
    assert slots.has_kernel and slots.kernels is None
    x = torch.randn(13, IN + 7, generator=torch.Generator().manual_seed(9)).to(dtype)[:, 3:3 + IN]
    layouts = [
        ([a, b, c], [(1, 4), (4, 5), (5, 13)]),  # row 0 belongs to no adapter
        ([c, a], [(0, 6), (6, 12)]),
        ([adapter("d", 8, keys, 4), a], [(0, 3), (3, 6)]),
        ([adapter("a", 8, keys, 5, digest="a2"), b], [(0, 2), (2, 12)]),
        ([c], [(2, 7)]),
    ]
    tolerance = {"float32": {"rtol": 1e-5, "atol": 1e-4}}.get(dtype_name, {"rtol": 2e-2, "atol": 2e-1})
    for adapters, segments in layouts:
        adapters = [cast(ad, dtype) for ad in adapters]
        plan = slots.plan(adapters, segments)
        assert plan.row_slot is not None and plan.row_slot.dtype == torch.int32
        batched = deltas(LoRAStep(slots=slots, decode_plan=plan), keys, x)
        plain = deltas(LoRAStep([(ad, [seg]) for ad, seg in zip(adapters, segments, strict=True)]), keys, x)
        for key in keys:
            torch.testing.assert_close(batched[key].float(), plain[key].float(), **tolerance)
            untouched = torch.ones(x.shape[0], dtype=torch.bool)
            for start, end in segments:
                untouched[start:end] = False
            assert (batched[key][untouched] == 1).all()
