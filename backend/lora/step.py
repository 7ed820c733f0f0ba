"""One step's adapters and the rows each one owns: the LoRA deltas of a mixed batch.

The model runner orders a step's rows so that each adapter's rows are contiguous within the decode
rows and within the prompt rows (backend/runner/model_runner.py), so an adapter owns at most two
row segments. After each targeted projection's base GEMM, every adapter adds its delta to its own
rows only: two small GEMMs per segment and projection, ``out[rows] += (x[rows] @ A.T) @ B.T``
(Punica's segmented shape), on views, with no gather or scatter. The decode rows take the adapters'
slots instead (backend/lora/slots.py: one kernel call per projection for every adapter, or one
batched GEMM pair where no kernel runs and two or more adapters share them). Base-model rows are
untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.lora.adapter import LoRAAdapter
from backend.lora.slots import DecodePlan, LoRASlots


@dataclass(slots=True)
class LoRAStep:
    # (adapter, its row segments [(start, end), ...]) for every adapter in the step, except the
    # decode rows ``decode_plan`` covers (LoRAManager.step_for says when the slots take them)
    groups: list[tuple[LoRAAdapter, list[tuple[int, int]]]] = field(default_factory=list)
    slots: LoRASlots | None = None
    decode_plan: DecodePlan | None = None

    def apply(
        self,
        key: tuple[int, str],  # (layer index, fused projection name)
        x: torch.Tensor,  # [num_tokens, in_features], the projection's input
        out: torch.Tensor,  # [num_tokens, out_features], its base output, updated in place
    ) -> None:
        if self.decode_plan is not None:
            self.slots.apply(self.decode_plan, key, x, out)
        for adapter, segments in self.groups:
            weights = adapter.weights.get(key)
            if weights is None:  # the adapter does not target this projection
                continue
            a, b = weights  # [parts x rank, in_features], [out_features, parts x rank]
            for start, end in segments:
                out[start:end].addmm_(x[start:end] @ a.t(), b.t())


class LoRAHook:
    """What every adapted projection of one model looks at: the running step's LoRAStep, or None."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


def segments_of(names: list[str | None], offset: int = 0) -> dict[str, list[tuple[int, int]]]:
    """Each adapter's contiguous row runs in a step whose rows belong to ``names`` (one per row;
    None for the base model), numbered from ``offset``."""
    runs: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for index in range(1, len(names) + 1):
        if index == len(names) or names[index] != names[start]:
            if names[start] is not None:
                runs.setdefault(names[start], []).append((offset + start, offset + index))
            start = index
    return runs
