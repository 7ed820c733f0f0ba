"""Parses ptxas' verbose report (-v / --ptxas-options=-v) into per-kernel resource usage.

The compile tests assert limits on it: registers (occupancy), static shared memory (48 KiB is the
most a block can declare statically) and spills (local-memory traffic the kernels must not have).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(slots=True)
class KernelResources:
    name: str
    arch: str
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0


def parse(log: str) -> dict[tuple[str, str], KernelResources]:
    """{(kernel name, arch): resources} from a ptxas -v report (NVRTC log or nvcc stderr)."""
    out: dict[tuple[str, str], KernelResources] = {}
    current: KernelResources | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault((m.group(1), m.group(2)), KernelResources(m.group(1), m.group(2)))
            continue
        if current is None:
            continue
        if m := _PROPS.search(line):
            current.stack_bytes, current.spill_store_bytes, current.spill_load_bytes = map(int, m.groups())
        if m := _USED.search(line):
            current.registers = int(m.group(1))
            if s := _SMEM.search(line):
                current.shared_bytes = int(s.group(1))
    return out
