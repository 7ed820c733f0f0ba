"""kernels/lora_bgmv.cu on a real GPU through CuPy (backend/lora/cuda_bgmv.py), against the
per-adapter torch path on the same device: mixed adapters, uneven rows, an untargeted part."""

from __future__ import annotations

import pytest
import torch

from backend.lora.cuda_bgmv import CudaBGMV
from backend.lora.slots import LoRASlots
from backend.lora.step import LoRAStep
from tests.unit.test_lora_slots import IN, MAX_RANK, adapter, deltas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_lora_kernels_equal_the_per_adapter_path(dtype):
    device = torch.device("cuda")
    keys = [(0, "o_proj"), (0, "gate_up_proj"), (1, "qkv_proj"), (1, "down_proj")]
    adapters = [adapter("a", 8, keys, 1), adapter("b", 4, keys[:3], 2, skip_part=1), adapter("c", 2, keys[2:], 3)]
    for ad in adapters:
        ad.weights = {key: (a.to(device, dtype), b.to(device, dtype)) for key, (a, b) in ad.weights.items()}
    slots = LoRASlots(3, MAX_RANK, dtype, device)
    slots.use_cuda(CudaBGMV(dtype))
    x = torch.randn(13, IN, device=device).to(dtype)
    segments = [(1, 4), (4, 5), (5, 13)]
    plan = slots.plan(adapters, segments)
    batched = deltas(LoRAStep(slots=slots, decode_plan=plan), keys, x)
    plain = deltas(LoRAStep([(ad, [seg]) for ad, seg in zip(adapters, segments, strict=True)]), keys, x)
    tolerance = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}
    for key in keys:
        torch.testing.assert_close(batched[key].float(), plain[key].float(), **tolerance)
        assert (batched[key][0] == 1).all()
