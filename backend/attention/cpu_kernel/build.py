"""Builds (once) and loads the CPU kernels: paged decode and prefill attention (``paged_decode.cpp``,
``paged_prefill.cpp``), the fused RMSNorm, SiLU x up and rotary embedding + cache write
(``fused_ops.cpp``), structured output's token mask (``token_bitmask.cpp``), the tensor-parallel
ranks' shared-memory barrier (``shm_barrier.cpp``), the LoRA deltas of a step's decode rows
(``lora_bgmv.cpp``) and a sparse MLP's experts (``moe_experts.cpp``), one shared library.
Built with ``-march=native`` (the library is built where it runs: AVX-512 and AVX512_BF16 paths
where the CPU has them, AVX2 otherwise) and ``-ffp-contract=off`` (float32 products that torch
rounds separately are not fused behind our back; the kernels ask for FMAs explicitly).

Why a plain shared library through ctypes rather than torch's cpp_extension: it compiles in about
a second with g++ (cpp_extension's torch headers take most of a minute on 2 cores), and it needs
nothing from torch but raw pointers. It is built with ``-fopenmp`` and loaded after torch, so its
``libgomp.so.1`` is the one torch already loaded (same soname): one OpenMP runtime and one thread
pool in the process, not two pools spinning against each other.

The library is cached under ``build/cpu_kernels/<digest>/`` (``LLM_CPU_KERNEL_DIR`` overrides the
root), keyed by the source, the flags and the compiler's version: a changed source rebuilds, and
two processes building at once each write a private file and rename it into place.
``load_kernel()`` returns the kernel or raises ``KernelUnavailable`` with the reason (no g++, a
failed compile); the selector falls back to the torch path and logs that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401 (torch's libgomp loads before the kernels' library, which shares it)

from backend.paths import REPO_ROOT

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "paged_decode.cpp", HERE / "paged_prefill.cpp", HERE / "fused_ops.cpp", HERE / "token_bitmask.cpp",
           HERE / "shm_barrier.cpp", HERE / "lora_bgmv.cpp", HERE / "moe_experts.cpp"]
HEADERS = [HERE / "simd.h"]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
LIBRARY_NAME = "libllm_cpu_kernels.so"


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be built or loaded here; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("LLM_CPU_KERNEL_DIR") or REPO_ROOT / "build" / "cpu_kernels")


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not found:
        raise KernelUnavailable("no C++ compiler (g++) on PATH")
    return found


# What the tests add to build the AVX2 paths on a CPU with AVX-512 (the CI machines may have either).
AVX2_ONLY_FLAGS = ("-mno-avx512f",)


def build_digest(cxx: str, extra_flags: tuple[str, ...] = ()) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{cxx} --version failed: {exc}") from None
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.read_bytes())
    digest.update(" ".join([*FLAGS, *extra_flags]).encode())
    digest.update(version.encode())
    return digest.hexdigest()[:16]


def build_library(extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached library, compiled first when missing; raises KernelUnavailable. ``extra_flags``
    (tests) builds a variant, e.g. AVX2_ONLY_FLAGS."""
    cxx = compiler()
    folder = cache_root() / build_digest(cxx, tuple(extra_flags))
    library = folder / LIBRARY_NAME
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=LIBRARY_NAME + ".", dir=folder)
    os.close(handle)
    command = [cxx, *FLAGS, *extra_flags, *map(str, SOURCES), "-o", partial]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        os.unlink(partial)
        raise KernelUnavailable(f"compiling the CPU kernels failed: {exc}") from None
    if result.returncode != 0:
        os.unlink(partial)
        raise KernelUnavailable(f"compiling the CPU kernels failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    os.replace(partial, library)
    logger.info("built the CPU kernels: %s", library)
    return library


class CpuKernels:
    """The loaded library: ``paged_decode``, ``fused_rms_norm``, ``fused_silu_mul``, ``fused_rope_cache``,
    ``apply_token_bitmask``, ``shm_barrier``, ``lora_bgmv``, ``moe_experts`` (ctypes functions)
    and the shape limits paged_decode was compiled with."""

    def __init__(self, path: Path):
        try:
            self.library = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelUnavailable(f"loading {path} failed: {exc}") from None
        self.path = path
        self.max_group = self.library.paged_decode_max_group()
        self.max_head_size = self.library.paged_decode_max_head_size()
        self.max_block_size = self.library.paged_decode_max_block_size()
        pointer, integer, size, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self.paged_decode = self._function("paged_decode", [integer, pointer, pointer, pointer, pointer, pointer,
                                                            pointer, integer, integer, integer, integer, integer,
                                                            integer, real, integer])
        self.prefill_available = bool(self.library.paged_prefill_available())
        self.paged_prefill = self._function("paged_prefill", [integer, pointer, pointer, pointer, pointer, pointer,
                                                              pointer, pointer, integer, integer, integer, integer,
                                                              integer, integer, integer, real, integer])
        self.fused_rms_norm = self._function("fused_rms_norm", [integer, pointer, pointer, pointer, pointer, size,
                                                                size, real])
        self.fused_silu_mul = self._function("fused_silu_mul", [integer, pointer, pointer, size, size])
        self.fused_rope_cache = self._function("fused_rope_cache", [integer, pointer, pointer, pointer, pointer,
                                                                    pointer, pointer, pointer, pointer, size, integer,
                                                                    integer, integer])
        self.apply_token_bitmask = self._function("apply_token_bitmask", [pointer, size, pointer, size, pointer,
                                                                          size, size])
        self.shm_barrier = self._function("shm_barrier", [pointer, size, integer, integer, ctypes.c_uint64, pointer,
                                                          ctypes.c_double])
        self.shm_barrier.restype = integer
        self.lora_bgmv = self._function("lora_bgmv", [integer, pointer, size, pointer, size, pointer, pointer, integer,
                                                      pointer, pointer, size, size, size, integer, pointer])
        self.moe_experts = self._function("moe_experts", [integer, pointer, size, size, size, pointer, pointer, size,
                                                          integer, integer, pointer, pointer, pointer])
        self.moe_experts_bf16_pairs = self.library.moe_experts_bf16_pairs
        self.moe_experts_bf16_pairs.restype, self.moe_experts_bf16_pairs.argtypes = integer, []

    def _function(self, name: str, argtypes: list):
        function = getattr(self.library, name)
        function.restype = None
        function.argtypes = argtypes
        return function

    def unsupported(self, group: int, head_size: int, block_size: int) -> str | None:
        """Why the kernel cannot serve these shapes, or None."""
        if group > self.max_group:
            return f"{group} query heads per KV head (the kernel takes up to {self.max_group})"
        if head_size > self.max_head_size:
            return f"head size {head_size} (the kernel takes up to {self.max_head_size})"
        if block_size > self.max_block_size:
            return f"block size {block_size} (the kernel takes up to {self.max_block_size})"
        return None


_lock = threading.Lock()
_loaded: CpuKernels | KernelUnavailable | None = None


def load_kernel() -> CpuKernels:
    """The kernel, built and loaded once per process; raises KernelUnavailable (remembered)."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = CpuKernels(build_library())
            except KernelUnavailable as exc:
                _loaded = exc
        if isinstance(_loaded, KernelUnavailable):
            raise _loaded
        return _loaded


if __name__ == "__main__":  # make setup: build it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    try:
        print(f"CPU kernels: {load_kernel().path}")
    except KernelUnavailable as exc:
        print(f"CPU kernels unavailable (the torch path serves): {exc}")
