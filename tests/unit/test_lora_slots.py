"""The decode rows' batched LoRA path (backend/lora/slots.py), on torch and through the CPU kernel
(``lora_bgmv``, this CPU's build and the AVX2-only one), against the per-adapter path: the same deltas
for adapters of different ranks and targets (a fused projection with an untargeted part), uneven rows
per adapter (padded slots), widths with vector remainders, an input that is a strided view, an
adapter taking over the slot of one the step does not use, and one reloaded with new weights."""

from __future__ import annotations

import pytest
import torch

from backend.attention.cpu_kernel import build
from backend.lora.adapter import FUSED, LoRAAdapter
from backend.lora.slots import LoRASlots
from backend.lora.step import LoRAStep

IN, MAX_RANK = 45, 8  # 45: a vector remainder in the shrink
PART_OUTS = {"qkv_proj": (37, 19, 19), "o_proj": (40,), "gate_up_proj": (70, 70), "down_proj": (45,)}  # remainders
_kernels: dict[str, build.CpuKernels] = {}


def kernels_for(path: str):
    if path == "torch":
        return None
    if path not in _kernels:
        flags = build.AVX2_ONLY_FLAGS if path == "avx2" else ()
        try:
            _kernels[path] = build.CpuKernels(build.build_library(flags))
        except build.KernelUnavailable as exc:  # pragma: no cover (g++ is part of the setup)
            pytest.fail(f"the CPU kernels do not build here: {exc}")
    return _kernels[path]


def adapter(name: str, rank: int, keys, seed: int, digest: str = "", skip_part: int | None = None) -> LoRAAdapter:
    """Random A and a block-diagonal B per fused projection, as load_adapter lays PEFT's out;
    ``skip_part``: that part is not targeted (zeros)."""
    gen = torch.Generator().manual_seed(seed)
    weights, columns = {}, {}
    for key in keys:
        outs = PART_OUTS[key[1]]
        parts = len(FUSED[key[1]])
        a = torch.randn(parts * rank, IN, generator=gen)
        b = torch.zeros(sum(outs), parts * rank)
        row = 0
        for part, width in enumerate(outs):
            if part != skip_part:
                b[row:row + width, part * rank:(part + 1) * rank] = torch.randn(width, rank, generator=gen)
            else:
                a[part * rank:(part + 1) * rank] = 0
            row += width
        weights[key] = (a, b)
    for fused, outs in PART_OUTS.items():
        columns[fused] = tuple(sum(outs[:i]) for i in range(len(outs) + 1))
    return LoRAAdapter(name, rank, 1.0, digest or name, ("q_proj",), weights, columns)


def cast(ad: LoRAAdapter, dtype: torch.dtype, device: torch.device | str = "cpu") -> LoRAAdapter:
    weights = {key: (a.to(device, dtype), b.to(device, dtype)) for key, (a, b) in ad.weights.items()}
    return LoRAAdapter(ad.name, ad.rank, ad.scaling, ad.digest, ad.targets, weights, ad.part_columns)


def deltas(step: LoRAStep, keys, x: torch.Tensor) -> dict:
    found = {}
    for key in keys:
        out = torch.ones(x.shape[0], sum(PART_OUTS[key[1]]), dtype=x.dtype, device=x.device)  # a base output to add to
        step.apply(key, x, out)
        found[key] = out
    return found


KEYS = [(0, "o_proj"), (0, "gate_up_proj"), (1, "qkv_proj"), (1, "down_proj")]


def layouts() -> list[tuple[list[LoRAAdapter], list[tuple[int, int]]]]:
    """Steps in order, one slot set across them: (adapters, each one's decode rows)."""
    a = adapter("a", 8, KEYS, 1)
    b = adapter("b", 4, KEYS[:3], 2, skip_part=1)  # a lower rank, not every projection, k (and up) untargeted
    c = adapter("c", 2, KEYS[2:], 3)
    return [
        ([a, b, c], [(1, 4), (4, 5), (5, 13)]),  # uneven: padded slots; 8 rows: two row blocks of the kernel; row 0 has none
        ([c, a], [(0, 6), (6, 12)]),  # b's slot is free for nobody new; c and a keep theirs
        ([adapter("d", 8, KEYS, 4), a], [(0, 3), (3, 6)]),  # d takes over a slot this step does not use
        ([adapter("a", 8, KEYS, 5, digest="a2"), b], [(0, 2), (2, 12)]),  # a reloaded with new weights
        ([c], [(2, 7)]),  # one adapter alone
    ]


def strided_input(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """[13, IN] decode rows, a view with a row stride larger than its width."""
    wide = torch.randn(13, IN + 7, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    return wide[:, 3:3 + IN]


def checked_steps(slots: LoRASlots, x: torch.Tensor, tolerance: dict):
    """Runs every layout through ``slots`` and through the per-adapter path; asserts the same deltas
    and the base output kept on rows of no adapter; yields (adapters, plan) for the caller's checks."""
    for adapters, segments in layouts():
        adapters = [cast(ad, slots.dtype, slots.device) for ad in adapters]
        plan = slots.plan(adapters, segments)
        batched = deltas(LoRAStep(slots=slots, decode_plan=plan), KEYS, x)
        plain = deltas(LoRAStep([(ad, [seg]) for ad, seg in zip(adapters, segments, strict=True)]), KEYS, x)
        untouched = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        for start, end in segments:
            untouched[start:end] = False
        for key in KEYS:
            torch.testing.assert_close(batched[key].float(), plain[key].float(), **tolerance)
            assert (batched[key][untouched] == 1).all()  # rows of no adapter keep the base output
        yield adapters, plan


def tolerance_for(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["torch", "native", "avx2"])
def test_batched_decode_rows_equal_the_per_adapter_path(path, dtype):
    slots = LoRASlots(3, MAX_RANK, dtype, torch.device("cpu"))
    slots.use_kernels(kernels_for(path))
    assert (slots.kernels is None) == (path == "torch")
    x = strided_input(dtype)
    assert not x.is_contiguous()
    for adapters, _ in checked_steps(slots, x, tolerance_for(dtype)):
        assert sorted(n for n in slots.names if n in {ad.name for ad in adapters}) == sorted(ad.name for ad in adapters)
