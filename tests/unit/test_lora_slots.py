"""The decode rows' batched LoRA path (backend/lora/slots.py) against the per-adapter path: the same
deltas for adapters of different ranks and targets, uneven rows per adapter (padded slots), an
adapter taking over the slot of one the step does not use, and one reloaded with new weights."""

from __future__ import annotations

import torch

from backend.lora.adapter import LoRAAdapter
from backend.lora.slots import LoRASlots
from backend.lora.step import LoRAStep

IN, OUT, MAX_RANK = 24, 40, 8


def adapter(name: str, rank: int, keys, seed: int, digest: str = "") -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {key: (torch.randn(2 * rank if key[1] == "gate_up_proj" else rank, IN, generator=gen),
                     torch.randn(OUT, 2 * rank if key[1] == "gate_up_proj" else rank, generator=gen))
               for key in keys}
    return LoRAAdapter(name, rank, 1.0, digest or name, ("q_proj",), weights)


def deltas(step: LoRAStep, keys, x: torch.Tensor) -> dict:
    found = {}
    for key in keys:
        out = torch.zeros(x.shape[0], OUT)
        step.apply(key, x, out)
        found[key] = out
    return found


def test_batched_decode_rows_equal_the_per_adapter_path():
    keys = [(0, "o_proj"), (0, "gate_up_proj"), (1, "o_proj")]
    a = adapter("a", 8, keys, 1)
    b = adapter("b", 4, keys[:2], 2)  # a lower rank, and not every projection
    c = adapter("c", 2, keys[2:], 3)
    slots = LoRASlots(3, MAX_RANK, torch.float32, torch.device("cpu"))
    x = torch.randn(12, IN, generator=torch.Generator().manual_seed(9))
    layouts = [
        ([a, b, c], [(1, 4), (4, 5), (5, 9)]),  # uneven: padded slots
        ([c, a], [(0, 6), (6, 12)]),  # b's slot is free for nobody new; c and a keep theirs
        ([adapter("d", 8, keys, 4), a], [(0, 3), (3, 6)]),  # d takes over a slot this step does not use
        ([adapter("a", 8, keys, 5, digest="a2"), b], [(0, 2), (2, 12)]),  # a reloaded with new weights
    ]
    for adapters, segments in layouts:
        plan = slots.plan(adapters, segments)
        batched = deltas(LoRAStep(slots=slots, decode_plan=plan), keys, x)
        plain = deltas(LoRAStep([(ad, [seg]) for ad, seg in zip(adapters, segments, strict=True)]), keys, x)
        for key in keys:
            torch.testing.assert_close(batched[key], plain[key], rtol=1e-5, atol=1e-5)
        assert sorted(n for n in slots.names if n in {ad.name for ad in adapters}) == sorted(ad.name for ad in adapters)
