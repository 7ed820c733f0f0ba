"""CUDA kernels (*.cu, loaded by cupy.RawModule) and the tools that check them without a GPU.

Importing this package needs neither CuPy nor a GPU: ``build_options`` says which sources and
compile options the cupy attention backend uses; ``nvrtc``/``nvcc`` compile them for the tests;
``emulation`` runs them on the CPU.
"""

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

__all__ = ["KERNEL_DIR"]
