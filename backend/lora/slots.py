"""The adapters of the running batch stacked in ``max_loras`` slots, so that a step's decode rows of
every adapter take one batched GEMM pair per projection (Punica's BGMV shape) instead of one pair
per adapter.

Why: a decode step of 64 rows spread over 8 adapters gave each adapter 8 rows, and two small GEMMs
per adapter and projection cost three times the projection's own GEMM (perf/RESULTS.md, "LoRA").
Each slot holds one adapter's fused A and B for every projection, padded with zeros to
``max_lora_rank`` (a part the adapter does not target is zeros, so its delta is zero); an adapter is
copied into a slot when a step first needs it there (a slot whose adapter this step does not use is
taken over), never per step. The step's plan (``DecodePlan``) gathers each slot's rows into
``[slots, rows_per_slot, in]`` (rows of a slot with fewer rows point at row 0 and are masked out),
runs ``bmm`` with the slots' A and B, and adds the result back to the rows (``index_add_``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.lora.adapter import FUSED, LoRAAdapter


@dataclass(slots=True)
class DecodePlan:
    """One step's decode rows, by slot."""

    num_slots: int  # slots 0 .. num_slots - 1 take part (idle ones among them have only masked rows)
    rows_per_slot: int
    gather: torch.Tensor  # [num_slots * rows_per_slot] int64: the row of each slot position (0 where padded)
    mask: torch.Tensor | None  # [num_slots * rows_per_slot, 1] model dtype: 0 where padded; None when none is
    keys: frozenset  # (layer, fused projection) some adapter of the step targets


class LoRASlots:
    def __init__(self, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.names: list[str | None] = [None] * num_slots
        self.max_rank, self.dtype, self.device = max_rank, dtype, device
        # (layer, fused projection) -> (A [slots, parts x max_rank, in], B [slots, out, parts x max_rank])
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._digests: list[str | None] = [None] * num_slots  # what each slot holds, by weights digest

    def place(self, adapters: list[LoRAAdapter]) -> list[int]:
        """The slot of each of ``adapters`` (at most as many as there are slots), copying in the ones
        not there yet."""
        wanted = {adapter.name for adapter in adapters}
        found = []
        for adapter in adapters:
            if adapter.name in self.names:
                slot = self.names.index(adapter.name)
                if self._digests[slot] != adapter.digest:  # loaded again from a changed folder
                    self._write(slot, adapter)
            else:
                slot = next(i for i, name in enumerate(self.names) if name is None or name not in wanted)
                self._write(slot, adapter)
            found.append(slot)
        return found

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, (a, b) in adapter.weights.items():
            if key not in self.weights:
                parts = len(FUSED[key[1]]) * self.max_rank
                self.weights[key] = (
                    torch.zeros(len(self.names), parts, a.shape[1], dtype=self.dtype, device=self.device),
                    torch.zeros(len(self.names), b.shape[0], parts, dtype=self.dtype, device=self.device))
        for key, (slot_a, slot_b) in self.weights.items():
            slot_a[slot].zero_()
            slot_b[slot].zero_()
            if key in adapter.weights:
                a, b = adapter.weights[key]
                slot_a[slot, : a.shape[0]].copy_(a)
                slot_b[slot, :, : b.shape[1]].copy_(b)
        self.names[slot] = adapter.name
        self._digests[slot] = adapter.digest

    def plan(self, adapters: list[LoRAAdapter], segments: list[tuple[int, int]]) -> DecodePlan:
        """The plan for ``adapters``' decode rows ``segments`` (one contiguous run each)."""
        slots = self.place(adapters)
        num_slots = max(slots) + 1
        per_slot = max(end - start for start, end in segments)
        gather = torch.zeros(num_slots * per_slot, dtype=torch.int64)
        mask = torch.zeros(num_slots * per_slot, 1, dtype=self.dtype)
        for slot, (start, end) in zip(slots, segments, strict=True):
            gather[slot * per_slot : slot * per_slot + end - start] = torch.arange(start, end)
            mask[slot * per_slot : slot * per_slot + end - start] = 1
        padded = sum(end - start for start, end in segments) < num_slots * per_slot
        keys = frozenset(key for adapter in adapters for key in adapter.weights)
        return DecodePlan(num_slots, per_slot, gather.to(self.device),
                          mask.to(self.device) if padded else None, keys)

    def apply(
        self,
        plan: DecodePlan,
        key: tuple[int, str],
        x: torch.Tensor,  # [num_tokens, in_features], the projection's input
        out: torch.Tensor,  # [num_tokens, out_features], its output, updated in place
    ) -> None:
        if key not in plan.keys:
            return
        slot_a, slot_b = self.weights[key]
        count, rows = plan.num_slots, plan.rows_per_slot
        gathered = x.index_select(0, plan.gather).view(count, rows, x.shape[1])  # [slots, rows, in]
        shrunk = torch.bmm(gathered, slot_a[:count].transpose(1, 2))  # [slots, rows, parts x max_rank]
        delta = torch.bmm(shrunk, slot_b[:count].transpose(1, 2)).view(count * rows, out.shape[1])
        if plan.mask is not None:
            delta.mul_(plan.mask)
        out.index_add_(0, plan.gather, delta)
