"""Builds a kernel source into a shared library that runs on the CPU (g++ + cuda_emu.h).

Variants: ``plain`` (-O2), ``tsan`` (ThreadSanitizer) and ``asan`` (AddressSanitizer + UBSan).
A sanitizer variant can only be loaded into a process that has the sanitizer runtime preloaded
(``LD_PRELOAD=$(sanitizer_runtime(variant))``). Libraries are cached under build/kernels/emulation
(override with KERNEL_BUILD_DIR) by a hash of everything that goes into them, so a test run
compiles only what changed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cache, lru_cache
from pathlib import Path

from kernels import KERNEL_DIR
from kernels.build_options import ModuleSpec

EMULATION_DIR = KERNEL_DIR / "emulation"
CXX = os.environ.get("CXX", "g++")

_COMMON_FLAGS = (
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",  # the kernels reinterpret cache rows as 16-byte vectors
    "-fno-fast-math",  # the half conversions rely on IEEE round-to-nearest-even
    "-Wall",
    "-Wno-unknown-pragmas",  # #pragma unroll
    "-Werror=return-type",
)
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "plain": ("-O2",),
    "tsan": ("-O1", "-g", "-fsanitize=thread"),
    "asan": (
        "-O1",
        "-g",
        "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
    ),
}
_RUNTIME = {"tsan": "libtsan.so", "asan": "libasan.so"}
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def _compiler_env() -> dict[str, str]:
    """The environment for g++: without a sanitizer runtime preloaded by a sanitizer test run."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def build_dir() -> Path:
    return Path(os.environ.get("KERNEL_BUILD_DIR", KERNEL_DIR.parent / "build" / "kernels" / "emulation"))


def kernel_names(code: str) -> list[str]:
    """The extern "C" __global__ functions of a source, in order."""
    return _KERNEL_RE.findall(code)


@lru_cache(maxsize=1)
def _compiler_id() -> str:
    return subprocess.run(
        [CXX, "--version"], capture_output=True, text=True, check=True, env=_compiler_env()
    ).stdout


@cache
def sanitizer_runtime(variant: str) -> str | None:
    """Path of the runtime to LD_PRELOAD for a sanitizer variant, or None where g++ has none."""
    name = _RUNTIME[variant]
    if shutil.which(CXX) is None:
        return None
    path = subprocess.run(
        [CXX, f"-print-file-name={name}"], capture_output=True, text=True, env=_compiler_env()
    ).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _headers_digest() -> bytes:
    h = hashlib.sha256()
    for path in sorted([*KERNEL_DIR.glob("*.cuh"), *EMULATION_DIR.rglob("*.h")]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.digest()


_pch_lock = threading.Lock()


def _precompiled_header(variant: str, flags: tuple[str, ...]) -> Path:
    """cuda_emu.h precompiled once per variant (it is most of each build's compile time).

    Returns the header path to pass to -include; g++ picks up the .gch beside it, and falls back
    to the header text if the .gch does not match the flags.
    """
    key = hashlib.sha256()
    for part in (_compiler_id(), "\0".join(flags)):
        key.update(part.encode())
    key.update(_headers_digest())
    pch_dir = build_dir() / f"pch-{variant}-{key.hexdigest()[:20]}"
    header = pch_dir / "cuda_emu.h"
    with _pch_lock:
        if not (pch_dir / "cuda_emu.h.gch").exists():
            pch_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(EMULATION_DIR / "cuda_emu.h", header)
            _compile([*flags, f"-I{EMULATION_DIR / 'include'}", "-x", "c++-header", str(header)],
                     pch_dir / f"cuda_emu.h.gch.{os.getpid()}", pch_dir / "cuda_emu.h.gch", "to precompile cuda_emu.h")
    return header


def _compile(arguments: list[str], tmp: Path, out: Path, what: str) -> None:
    """g++ ``arguments`` into ``tmp``, then renamed to ``out`` (atomic: a concurrent build of the
    same key is harmless); a failure raises with g++'s errors and ``what`` was built."""
    proc = subprocess.run([CXX, *arguments, "-o", str(tmp)], capture_output=True, text=True, env=_compiler_env())
    if proc.returncode != 0:
        raise RuntimeError(f"g++ failed {what}:\n{proc.stderr}")
    os.replace(tmp, out)


def build_emulated(spec: ModuleSpec, variant: str = "plain", code: str | None = None) -> Path:
    """Compiles ``spec`` (or ``code`` in place of its source, e.g. a planted bug) for the CPU.

    Returns the path of the cached shared library; raises RuntimeError with g++'s output.
    """
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"unknown emulation variant {variant!r}")
    if shutil.which(CXX) is None:
        raise RuntimeError(f"{CXX} not found: the CPU kernel emulation needs a C++17 compiler")
    code = spec.code() if code is None else code
    names = kernel_names(code)
    if not names:
        raise RuntimeError(f'{spec.source}: no extern "C" __global__ kernel found')
    variant_flags = (*_COMMON_FLAGS, *VARIANT_FLAGS[variant])
    flags = (*variant_flags, *spec.options)
    wrapper = "".join(f"EMU_EXPORT({name})\n" for name in names)
    key = hashlib.sha256()
    for part in (_compiler_id(), "\0".join(flags), code, wrapper):
        key.update(part.encode())
        key.update(b"\0")
    key.update(_headers_digest())
    digest = key.hexdigest()[:20]
    out_dir = build_dir()
    lib = out_dir / f"{Path(spec.source).stem}-{variant}-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    header = _precompiled_header(variant, variant_flags)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / spec.source
        src.write_text(code)
        unit = Path(tmp) / "unit.cpp"
        unit.write_text(f'#include "{src}"\n{wrapper}')
        _compile([*flags, "-include", str(header), f"-I{EMULATION_DIR / 'include'}", f"-I{KERNEL_DIR}", str(unit)],
                 Path(tmp) / lib.name, lib, f"for {spec.source} {' '.join(spec.options)}")
    return lib


def build_many(jobs: Iterable[tuple[ModuleSpec, str]]) -> list[Path]:
    """Builds several (spec, variant) pairs in parallel, one g++ per core."""
    jobs = list(jobs)
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: build_emulated(*job), jobs))
