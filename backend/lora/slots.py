"""The adapters of the running batch stacked in ``max_loras`` slots, so that a step's decode rows of
every adapter take one batched computation per projection (Punica's BGMV shape) instead of one GEMM
pair per adapter.

Why: a decode step of 64 rows spread over 8 adapters gave each adapter 8 rows, and two small GEMMs
per adapter and projection cost three times the projection's own GEMM (perf/RESULTS.md, "LoRA").
Each slot holds one adapter's A and B for every projection, padded with zeros to ``max_lora_rank``
(a projection the adapter does not target is zeros, so its delta is zero); an adapter is copied into
a slot when a step first needs it there (a slot whose adapter this step does not use is taken over),
never per step. A fused projection's parts (q/k/v, gate/up) each read only their own rank entries
(PEFT's fused B is block-diagonal), so a slot keeps A as ``[parts x max_rank, in]`` (part p from row
p x max_rank) and B compact and transposed, ``[max_rank, out]``.

On CPUs the step's decode rows go through one kernel call per projection (``lora_bgmv`` in the CPU
kernel library: each slot's rows stay where they are, its weights are read once); on a GPU with the
CuPy attention backend, through kernels/lora_bgmv.cu (backend/lora/cuda_bgmv.py), two launches per
projection with each row's slot. Elsewhere (no compiler, torch attention) torch runs it: each slot's rows gathered into ``[slots, rows_per_slot, in]`` (rows of
a slot with fewer rows point at row 0 and are masked out), ``bmm`` with the slots' A, one ``bmm`` per
part with B, and the result added back to the rows (``index_add_``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from backend.attention.cpu_kernel.dtypes import KERNEL_DTYPES
from backend.lora.adapter import FUSED, LoRAAdapter


@dataclass(slots=True)
class DecodePlan:
    """One step's decode rows, by slot."""

    num_slots: int  # slots 0 .. num_slots - 1 take part (idle ones among them have no rows)
    keys: frozenset  # (layer, fused projection) some adapter of the step targets
    # the CPU kernel's: slot s owns rows [row_start[s], row_end[s]) ([num_slots] int64 each)
    row_start: torch.Tensor | None = None
    row_end: torch.Tensor | None = None
    # the CUDA kernels': [rows] int32 on the device, each of the first rows' slot (-1: none)
    row_slot: torch.Tensor | None = None
    # torch's
    rows_per_slot: int = 0
    gather: torch.Tensor | None = None  # [num_slots * rows_per_slot] int64: the row of each slot position (0 where padded)
    mask: torch.Tensor | None = None  # [num_slots * rows_per_slot, 1] model dtype: 0 where padded; None when none is


class LoRASlots:
    def __init__(self, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.names: list[str | None] = [None] * num_slots
        self.max_rank, self.dtype, self.device = max_rank, dtype, device
        self.kernels = None  # see use_kernels
        self.cuda = None  # see use_cuda
        # (layer, fused projection) -> (A [slots, parts x max_rank, in], B^T [slots, max_rank, out])
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.part_columns: dict[tuple[int, str], tuple[int, ...]] = {}  # each part's output columns, as offsets
        self._part_offsets: dict[tuple[int, str], torch.Tensor] = {}  # the same, int64, for the kernel
        self._digests: list[str | None] = [None] * num_slots  # what each slot holds, by weights digest

    def use_kernels(self, kernels) -> None:
        """Decode rows go through ``kernels.lora_bgmv`` (the CPU kernel library,
        backend/attention/cpu_kernel/build.py) where it can take them; None: torch."""
        self.kernels = kernels if self.device.type == "cpu" and self.dtype in KERNEL_DTYPES else None

    def use_cuda(self, cuda_bgmv) -> None:
        """Decode rows go through kernels/lora_bgmv.cu (a backend/lora/cuda_bgmv.py CudaBGMV)."""
        self.cuda = cuda_bgmv if self.dtype in (torch.float32, torch.float16, torch.bfloat16) else None

    @property
    def has_kernel(self) -> bool:
        """A kernel takes the decode rows (then even one adapter's go through the slots)."""
        return self.kernels is not None or self.cuda is not None

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
        rank, max_rank = adapter.rank, self.max_rank
        for key, (a, b) in adapter.weights.items():
            if key not in self.weights:
                parts = len(FUSED[key[1]])
                self.weights[key] = (
                    torch.zeros(len(self.names), parts * max_rank, a.shape[1], dtype=self.dtype, device=self.device),
                    torch.zeros(len(self.names), max_rank, b.shape[0], dtype=self.dtype, device=self.device))
                self.part_columns[key] = adapter.part_columns[key[1]]
                self._part_offsets[key] = torch.tensor(self.part_columns[key], dtype=torch.int64)
        for key, (slot_a, slot_bt) in self.weights.items():
            slot_a[slot].zero_()
            slot_bt[slot].zero_()
            if key not in adapter.weights:
                continue
            a, b = adapter.weights[key]  # [parts x rank, in], [out, parts x rank] block-diagonal
            columns = self.part_columns[key]
            for part in range(len(columns) - 1):
                slot_a[slot, part * max_rank: part * max_rank + rank].copy_(a[part * rank:(part + 1) * rank])
                slot_bt[slot, :rank, columns[part]:columns[part + 1]].copy_(
                    b[columns[part]:columns[part + 1], part * rank:(part + 1) * rank].t())
        self.names[slot] = adapter.name
        self._digests[slot] = adapter.digest

    def plan(self, adapters: list[LoRAAdapter], segments: list[tuple[int, int]]) -> DecodePlan:
        """The plan for ``adapters``' decode rows ``segments`` (one contiguous run each)."""
        slots = self.place(adapters)
        num_slots = max(slots) + 1
        keys = frozenset(key for adapter in adapters for key in adapter.weights)
        if self.kernels is not None:
            row_start = torch.zeros(num_slots, dtype=torch.int64)
            row_end = torch.zeros(num_slots, dtype=torch.int64)
            for slot, (start, end) in zip(slots, segments, strict=True):
                row_start[slot], row_end[slot] = start, end
            return DecodePlan(num_slots, keys, row_start=row_start, row_end=row_end)
        if self.cuda is not None:
            row_slot = torch.full((max(end for _, end in segments),), -1, dtype=torch.int32)
            for slot, (start, end) in zip(slots, segments, strict=True):
                row_slot[start:end] = slot
            return DecodePlan(num_slots, keys, row_slot=row_slot.to(self.device))
        per_slot = max(end - start for start, end in segments)
        gather = torch.zeros(num_slots * per_slot, dtype=torch.int64)
        mask = torch.zeros(num_slots * per_slot, 1, dtype=self.dtype)
        for slot, (start, end) in zip(slots, segments, strict=True):
            gather[slot * per_slot : slot * per_slot + end - start] = torch.arange(start, end)
            mask[slot * per_slot : slot * per_slot + end - start] = 1
        padded = sum(end - start for start, end in segments) < num_slots * per_slot
        return DecodePlan(num_slots, keys, rows_per_slot=per_slot, gather=gather.to(self.device),
                          mask=mask.to(self.device) if padded else None)

    def apply(
        self,
        plan: DecodePlan,
        key: tuple[int, str],
        x: torch.Tensor,  # [num_tokens, in_features], the projection's input
        out: torch.Tensor,  # [num_tokens, out_features], its output, updated in place
    ) -> None:
        if key not in plan.keys:
            return
        slot_a, slot_bt = self.weights[key]
        if plan.row_start is not None or plan.row_slot is not None:
            if x.stride(1) != 1:
                x = x.contiguous()
            if out.stride(1) != 1:  # a projection's own output always has unit column stride
                raise ValueError("lora_bgmv needs output rows with unit column stride")
        if plan.row_start is not None:
            pointer = ctypes.c_void_p
            columns = self._part_offsets[key]
            self.kernels.lora_bgmv(KERNEL_DTYPES[self.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                   pointer(plan.row_start.data_ptr()), pointer(plan.row_end.data_ptr()), plan.num_slots,
                                   slot_a.data_ptr(), slot_bt.data_ptr(), slot_a.shape[2], slot_bt.shape[2],
                                   self.max_rank, len(columns) - 1, pointer(columns.data_ptr()))
            return
        if plan.row_slot is not None:
            self.cuda.apply(x, out, plan.row_slot, slot_a, slot_bt, self.part_columns[key])
            return
        count, rows, rank = plan.num_slots, plan.rows_per_slot, self.max_rank
        gathered = x.index_select(0, plan.gather).view(count, rows, x.shape[1])  # [slots, rows, in]
        shrunk = torch.bmm(gathered, slot_a[:count].transpose(1, 2))  # [slots, rows, parts x max_rank]
        delta = torch.empty(count, rows, out.shape[1], dtype=out.dtype, device=out.device)
        columns = self.part_columns[key]
        for part in range(len(columns) - 1):
            delta[:, :, columns[part]:columns[part + 1]] = torch.bmm(
                shrunk[:, :, part * rank:(part + 1) * rank], slot_bt[:count, :, columns[part]:columns[part + 1]])
        delta = delta.view(count * rows, out.shape[1])
        if plan.mask is not None:
            delta.mul_(plan.mask)
        out.index_add_(0, plan.gather, delta)
