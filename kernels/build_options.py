"""Which kernel sources the cupy backend compiles, and with which options.

The single list of option combinations: the backend builds its cupy.RawModule objects from it at
model load, and the compile tests check every combination for sm_80 and sm_90. Dtypes are named
by their torch names so this module imports without torch or CuPy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kernels import KERNEL_DIR

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')

# torch dtype name -> C type of the cache, query and output elements
CTYPES: dict[str, str] = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
HEAD_SIZES: tuple[int, ...] = (32, 48, 64, 80, 96, 112, 128, 256)
NUM_THREADS = 128  # threads per block of the attention kernels
PARTITION_SIZE = 512  # context tokens per block of the decode kernel
THREAD_GROUP_SIZE = 8  # lanes that share one token
RESHAPE_MAX_THREADS = 128  # threads per block of reshape_and_cache
LORA_THREADS = 128  # threads per block of lora_shrink and lora_expand


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """One RawModule: a source file and its compile options."""

    source: str  # file name under kernels/
    options: tuple[str, ...]
    kernel_names: tuple[str, ...]

    def code(self) -> str:
        """The source with its local includes ("common.cuh") inlined: what gets compiled.

        Self-contained on purpose: CuPy's on-disk kernel cache is keyed by the source text and
        options, not by the headers it includes, so an edited header would load a stale binary.
        """
        return _inline(KERNEL_DIR / self.source, set())


def _inline(path: Path, seen: set[str]) -> str:
    out = []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), start=1):
        match = _LOCAL_INCLUDE.match(line)
        if match:
            name = match.group(1)
            if name not in seen:
                seen.add(name)
                out += [
                    f'#line 1 "{name}"\n',
                    _inline(path.parent / name, seen),
                    f'#line {number + 1} "{path.name}"\n',
                ]
            continue
        if line.strip() == "#pragma once":
            continue  # inlined once already; in the main file g++ would warn
        out.append(line)
    return "".join(out)


def paged_attention_spec(
    dtype: str, head_size: int, *, partition_size: int = PARTITION_SIZE, num_threads: int = NUM_THREADS
) -> ModuleSpec:
    """The decode-attention module for one cache dtype and head size."""
    if dtype not in CTYPES:
        raise ValueError(f"paged attention: unsupported dtype {dtype!r} (supported: {', '.join(CTYPES)})")
    if head_size % 8 != 0:
        raise ValueError(f"paged attention: head size {head_size} is not a multiple of 8")
    return ModuleSpec(
        "paged_attention.cu",
        (
            f"-DCACHE_T={CTYPES[dtype]}",
            f"-DHEAD_SIZE={head_size}",
            f"-DNUM_THREADS={num_threads}",
            f"-DPARTITION_SIZE={partition_size}",
            f"-DTHREAD_GROUP_SIZE={THREAD_GROUP_SIZE}",
        ),
        ("paged_attention_decode", "paged_attention_reduce"),
    )


def reshape_and_cache_spec(dtype: str) -> ModuleSpec:
    """The cache-write module for one cache dtype."""
    if dtype not in CTYPES:
        raise ValueError(f"reshape_and_cache: unsupported dtype {dtype!r} (supported: {', '.join(CTYPES)})")
    return ModuleSpec(
        "reshape_and_cache.cu", ("-std=c++17", f"-DCACHE_T={CTYPES[dtype]}"), ("reshape_and_cache",)
    )


def lora_bgmv_spec(dtype: str) -> ModuleSpec:
    """The LoRA decode-rows module (shrink and expand over adapter slots) for one dtype."""
    if dtype not in CTYPES:
        raise ValueError(f"lora_bgmv: unsupported dtype {dtype!r} (supported: {', '.join(CTYPES)})")
    return ModuleSpec("lora_bgmv.cu", (f"-DLORA_T={CTYPES[dtype]}",), ("lora_shrink", "lora_expand"))


def all_specs() -> list[ModuleSpec]:
    """Every module the backend can build: all dtypes x head sizes, the cache writers and the LoRA
    modules."""
    specs = [paged_attention_spec(dtype, hs) for dtype in CTYPES for hs in HEAD_SIZES]
    specs += [reshape_and_cache_spec(dtype) for dtype in CTYPES]
    specs += [lora_bgmv_spec(dtype) for dtype in CTYPES]
    return specs
