"""Compiles CUDA sources with NVRTC through ctypes: no GPU, driver or CuPy needed.

Uses libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel and the CUDA headers (cuda_fp16.h,
cuda_bf16.h) from the nvidia-cuda-runtime-cu12 wheel, falling back to a CUDA toolkit. This is the
compiler cupy.RawModule uses at model load, so a source that compiles here compiles there; with a
real architecture (-arch=sm_90) NVRTC runs ptxas and its -v report is in the log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


class NvrtcError(RuntimeError):
    """NVRTC is missing, or rejected the source (the message holds its log)."""


def _wheel_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _toolkit_dirs() -> list[Path]:
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    return [Path(r) for r in roots if r]


@lru_cache(maxsize=1)
def cuda_include_dir() -> Path | None:
    """A folder with cuda_fp16.h and cuda_bf16.h matching the NVRTC that will compile.

    The nvidia-cuda-runtime-cu12 wheel's when the nvidia-cuda-nvrtc-cu12 wheel is installed too
    (same release), else a CUDA toolkit's (CUDA_PATH, CUDA_HOME, /usr/local/cuda), else the wheel's.
    """
    wheel = _wheel_dir("nvidia.cuda_runtime")
    wheel_include = [wheel / "include"] if wheel is not None else []
    toolkit = [root / "include" for root in _toolkit_dirs()]
    order = (
        wheel_include + toolkit if _wheel_dir("nvidia.cuda_nvrtc") is not None else toolkit + wheel_include
    )
    for folder in order:
        if (folder / "cuda_fp16.h").exists() and (folder / "cuda_bf16.h").exists():
            return folder
    return None


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    candidates = []
    wheel = _wheel_dir("nvidia.cuda_nvrtc")
    if wheel is not None:
        candidates += sorted((wheel / "lib").glob("libnvrtc.so*"))
    for root in _toolkit_dirs():
        candidates += sorted((root / "lib64").glob("libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(Path(found))
    errors = []
    for path in candidates:
        if "builtins" in path.name or ".alt." in path.name:
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise NvrtcError(
        "libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12"
        + "".join("\n" + e for e in errors)
    )


def available() -> tuple[bool, str]:
    """(True, version) when NVRTC and the CUDA headers can be found, else (False, why)."""
    try:
        _lib()
    except NvrtcError as exc:
        return False, str(exc)
    if cuda_include_dir() is None:
        return False, "cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu12"
    return True, version()


def version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _lib().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


@dataclass(frozen=True, slots=True)
class NvrtcResult:
    binary: bytes  # CUBIN for a real architecture (sm_XX), PTX for a virtual one (compute_XX)
    log: str  # NVRTC's log; with --ptxas-options=-v, ptxas' resource report


def compile_source(
    code: str,
    options: tuple[str, ...],
    arch: str,
    *,
    name: str = "kernel.cu",
    include_dirs: tuple[Path, ...] = (),
) -> NvrtcResult:
    """Compiles ``code`` for ``arch`` (e.g. "sm_90") with ptxas' verbose report in the log."""
    lib = _lib()
    include = cuda_include_dir()
    if include is None:
        raise NvrtcError("cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu12")
    opts = [
        f"-arch={arch}",
        "--ptxas-options=-v",
        f"-I{include}",
        *(f"-I{d}" for d in include_dirs),
        *options,
    ]
    prog = ctypes.c_void_p()
    _check(
        lib, lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None), "create"
    )
    try:
        arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise NvrtcError(f"NVRTC failed for {name} {' '.join(opts)}:\n{log}")
        real = arch.startswith("sm_")
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if real else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(prog, ctypes.byref(size)), "size")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, out), "get")
        return NvrtcResult(out.raw, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise NvrtcError(f"nvrtc {what}: {lib.nvrtcGetErrorString(rc).decode()}")
