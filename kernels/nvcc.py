"""Compiles a kernel source to a fatbin with nvcc, when nvcc is installed.

NVRTC (what CuPy uses) and nvcc do not accept exactly the same code: nvcc compiles host-side
headers that NVRTC lacks (INFINITY from math.h builds with nvcc, not with NVRTC), and NVRTC has
built-ins nvcc does not. The compile tests run both; this is the nvcc half.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kernels import KERNEL_DIR
from kernels.build_options import ModuleSpec


def find_nvcc() -> str | None:
    """Path of nvcc (PATH, then /usr/local/cuda/bin), or None."""
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def version() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        return "none"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def compile_fatbin(spec: ModuleSpec, archs: tuple[str, ...], output: Path) -> str:
    """Builds kernels/<spec.source> for ``archs`` (e.g. ("sm_80", "sm_90")) into ``output``.

    Returns ptxas' verbose report (stderr); raises RuntimeError with nvcc's output on failure.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    cmd = [
        nvcc,
        "-fatbin",
        *gencode,
        "-Xptxas",
        "-v",
        f"-I{KERNEL_DIR}",
        *spec.options,
        str(KERNEL_DIR / spec.source),
        "-o",
        str(output),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.stderr + proc.stdout
