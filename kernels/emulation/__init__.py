"""Runs the .cu kernels on the CPU: a C++ emulation header, a g++ build with a cache, a ctypes
launcher with cupy.RawKernel's call shape. For tests on machines without a GPU."""

from kernels.emulation.build import build_emulated, build_many, sanitizer_runtime
from kernels.emulation.launcher import EmulatedKernel, EmulatedKernelError, EmulatedModule

__all__ = [
    "EmulatedKernel",
    "EmulatedKernelError",
    "EmulatedModule",
    "build_emulated",
    "build_many",
    "sanitizer_runtime",
]
