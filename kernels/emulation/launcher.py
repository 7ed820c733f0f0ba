"""Launches CPU-emulated kernels with the call shape of cupy.RawKernel.

``EmulatedModule(path).get_function(name)(grid, block, args)`` runs the kernel on the CPU. Like the
GPU it takes pointers and scalars, and like CuPy it turns a Python int into int64 and a float into
float64; unlike the GPU it knows each parameter's type (compiled into the library from the kernel's
signature) and rejects an argument of the wrong dtype: an int64 block table passed where the kernel
reads int32 fails here instead of producing garbage there.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np

_SCALAR_CTYPES = {
    "float32": ctypes.c_float,
    "float64": ctypes.c_double,
    "bool": ctypes.c_bool,
    "int8": ctypes.c_int8,
    "uint8": ctypes.c_uint8,
    "int16": ctypes.c_int16,
    "uint16": ctypes.c_uint16,
    "int32": ctypes.c_int32,
    "uint32": ctypes.c_uint32,
    "int64": ctypes.c_int64,
    "uint64": ctypes.c_uint64,
}


class EmulatedKernelError(RuntimeError):
    """The emulated kernel broke a CUDA rule (barrier divergence, shuffle mask, deadlock, ...)."""


def _array_dtype_and_pointer(arg: Any) -> tuple[str, int] | None:
    if arg is None:
        return "null", 0
    if isinstance(arg, np.ndarray):
        return arg.dtype.name, arg.ctypes.data
    if type(arg).__module__.startswith("torch") and hasattr(arg, "data_ptr"):
        if arg.device.type != "cpu":
            raise TypeError(f"emulated kernels take CPU tensors, got one on {arg.device}")
        return str(arg.dtype).removeprefix("torch."), arg.data_ptr()
    return None


def _scalar_dtype(arg: Any) -> str | None:
    if isinstance(arg, np.generic):
        return arg.dtype.name
    if isinstance(arg, bool):
        return "bool"
    if isinstance(arg, int):
        return "int64"  # what cupy passes for a Python int
    if isinstance(arg, float):
        return "float64"
    return None


def _dim3(value: int | tuple[int, ...]) -> ctypes.Array:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"grid/block must have 1 to 3 dimensions, got {value!r}")
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    return (ctypes.c_uint * 3)(*dims)


class EmulatedKernel:
    """One kernel of an emulated module; call it like cupy.RawKernel."""

    def __init__(self, lib: ctypes.CDLL, name: str, lock: threading.Lock) -> None:
        self.name = name
        self._lock = lock
        signature = getattr(lib, f"emu_signature_{name}")
        signature.restype = ctypes.c_char_p
        self.param_types: tuple[str, ...] = tuple(signature().decode().split(","))
        self._launch = getattr(lib, f"emu_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_int,
        ]

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None, **_ignored) -> None:
        if shared_mem:
            raise ValueError("dynamic shared memory is not emulated")
        if len(args) != len(self.param_types):
            raise TypeError(f"{self.name}: takes {len(self.param_types)} arguments, got {len(args)}")
        holders = []  # keep the ctypes values alive during the call
        pointers = (ctypes.c_void_p * len(args))()
        for i, (arg, expected) in enumerate(zip(args, self.param_types, strict=True)):
            if expected.endswith("*"):
                found = _array_dtype_and_pointer(arg)
                if found is None:
                    raise TypeError(
                        f"{self.name}: argument {i} must be an array of {expected[:-1]}, got {type(arg).__name__}"
                    )
                dtype, address = found
                if dtype not in (expected[:-1], "null"):
                    raise TypeError(
                        f"{self.name}: argument {i} must be an array of {expected[:-1]}, got {dtype}"
                    )
                value = ctypes.c_void_p(address)
            else:
                dtype = _scalar_dtype(arg)
                if dtype != expected:
                    raise TypeError(
                        f"{self.name}: argument {i} must be a {expected} scalar (e.g. numpy.{expected}), "
                        f"got {type(arg).__name__}" + (f" ({dtype})" if dtype else "")
                    )
                value = _SCALAR_CTYPES[expected](arg)
            holders.append(value)
            pointers[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
        err = ctypes.create_string_buffer(2048)
        with self._lock:
            rc = self._launch(_dim3(grid), _dim3(block), pointers, err, len(err))
        if rc != 0:
            raise EmulatedKernelError(f"{self.name}: {err.value.decode(errors='replace')}")


class EmulatedModule:
    """A loaded emulation library; ``get_function`` as on cupy.RawModule."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        self._lock = threading.Lock()  # the emulation runs one launch at a time per library
        self._kernels: dict[str, EmulatedKernel] = {}

    def get_function(self, name: str) -> EmulatedKernel:
        if name not in self._kernels:
            self._kernels[name] = EmulatedKernel(self._lib, name, self._lock)
        return self._kernels[name]
