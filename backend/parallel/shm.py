"""All-reduce and gather through shared memory, for the ranks of one CPU host.

Why: gloo's collectives go through loopback TCP; on the VMs measured here one all-reduce costs
about a millisecond whatever its size, and a decode step makes two per layer (perf/RESULTS.md,
"Tensor parallelism"). vLLM's CPU backend has its own shared-memory all-reduce for the same reason.
Here each rank owns a slot in a file under /dev/shm that every rank maps: a collective copies the
rank's tensor into its slot, meets the others at a barrier (``shm_barrier.cpp``: spin, then yield;
a dead peer or a timeout ends it), and reads the slots it needs. Every rank sums the slots in rank
order, so every rank gets bit-identical results (bfloat16 and float16 sums are accumulated in
float32 and rounded once). Slots alternate between two sets by the collective's sequence number,
so a rank that races ahead to the next collective never writes a slot another rank still reads
(it cannot start the one after that before every rank has arrived at the next).

A tensor larger than a slot goes through gloo instead (every rank decides the same way, since
the shapes are the same on every rank). The file is unlinked once every rank has mapped it, so
nothing is left in /dev/shm when a rank is killed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile

import torch

SLOT_BYTES = 8 << 20  # one rank's data per collective; larger tensors go through gloo
FLAG_STRIDE_WORDS = 8  # one 64-byte cache line per rank's flag
SHM_FOLDER = "/dev/shm"
BARRIER_TIMEOUT_SECONDS = 120.0


class CollectiveFailed(RuntimeError):
    """A peer rank is gone, or did not arrive in time."""


def create_file(size: int, slot_bytes: int = SLOT_BYTES) -> str | None:
    """Rank 0: makes the shared file for ``size`` ranks; None where there is no /dev/shm."""
    if not os.path.isdir(SHM_FOLDER):
        return None

    handle, path = tempfile.mkstemp(prefix="llm-tp-", dir=SHM_FOLDER)
    try:
        os.ftruncate(handle, _file_bytes(size, slot_bytes))
    finally:
        os.close(handle)
    return path


def _file_bytes(size: int, slot_bytes: int) -> int:
    return 64 * size + 2 * size * slot_bytes


class ShmCollectives:
    def __init__(self, path: str, rank: int, size: int, peer_pids: list[int], kernels, slot_bytes: int = SLOT_BYTES):
        """Maps ``path``; ``peer_pids[r]`` is rank r's process id (0 where unknown: not watched)."""
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), _file_bytes(size, slot_bytes))
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._barrier = kernels.shm_barrier
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._pids = (ctypes.c_int32 * size)(*peer_pids)
        self._sequence = 0
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole file, as one tensor

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.slot_bytes

    def _slot(self, phase: int, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = 64 * self.size + (phase * self.size + rank) * self.slot_bytes
        return self._bytes[start : start + count * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Writes ``tensor`` into this rank's slot and waits for every rank; returns every rank's slot."""
        self._sequence += 1
        phase, count = self._sequence % 2, tensor.numel()
        self._slot(phase, self.rank, tensor.dtype, count).copy_(tensor.reshape(-1))
        code = self._barrier(self._address, FLAG_STRIDE_WORDS, self.rank, self.size, self._sequence, self._pids,
                             BARRIER_TIMEOUT_SECONDS)
        if code != 0:
            raise CollectiveFailed("a peer rank is gone" if code == -2
                                   else f"a peer rank did not arrive within {BARRIER_TIMEOUT_SECONDS:g} s")
        return [self._slot(phase, r, tensor.dtype, count) for r in range(self.size)]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` (contiguous) over the ranks, in place, in rank order."""
        slots = self._exchange(tensor)
        flat = tensor.view(-1)
        if tensor.dtype == torch.float32:
            flat.copy_(slots[0])
            for slot in slots[1:]:
                flat.add_(slot)
            return
        total = slots[0].float()
        for slot in slots[1:]:
            total.add_(slot)
        flat.copy_(total)

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor | None:  # local: [rows, columns]
        """Rank 0: every rank's columns side by side; the others: None (after the barrier)."""
        slots = self._exchange(local)
        if self.rank != 0:
            return None
        return torch.cat([slot.view(local.shape) for slot in slots], dim=1)

    def close(self) -> None:
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
