"""Emulated kernel modules for the kernel tests (CPU, g++), built once per session.

KERNEL_EMULATION_VARIANT picks the build (plain, tsan, asan; the sanitizer runs set it together
with LD_PRELOAD) and KERNEL_PLANTED_BUG plants one of tests/kernels/planted_bugs.py into the
sources (only the harness self-tests set it).
"""

from __future__ import annotations

import os
import shutil

import pytest

from kernels.build_options import ModuleSpec, lora_bgmv_spec, paged_attention_spec, reshape_and_cache_spec
from kernels.emulation import EmulatedModule, build_emulated, build_many
from tests.kernels import cases, planted_bugs

PLANTED_BUG = os.environ.get("KERNEL_PLANTED_BUG") or None
_modules: dict[tuple[ModuleSpec, str, str | None], EmulatedModule] = {}


def emulated_module(
    spec: ModuleSpec, variant: str = cases.VARIANT, bug: str | None = PLANTED_BUG
) -> EmulatedModule:
    """The CPU build of ``spec`` (cached), as a cupy.RawModule look-alike."""
    key = (spec, variant, bug)
    if key not in _modules:
        code = None if bug is None else planted_bugs.apply(bug, spec.source, spec.code())
        _modules[key] = EmulatedModule(build_emulated(spec, variant, code))
    return _modules[key]


def emulated_launch(kernel, grid, block, args) -> None:
    """The backend's launch hook for emulated kernels: call them as cupy.RawKernel."""
    kernel(grid, block, args)


def all_emulated_specs() -> list[ModuleSpec]:
    """Every module the kernel tests of the current variant load."""
    specs = {paged_attention_spec(d, hs, partition_size=p) for d, hs, p in cases.attention_configs()}
    specs |= {reshape_and_cache_spec(d) for d, *_ in cases.cache_write_configs()}
    specs |= {reshape_and_cache_spec(d) for d, *_ in cases.attention_configs()}
    specs |= {lora_bgmv_spec(d) for d in cases.lora_dtypes()}
    return sorted(specs, key=lambda s: s.options)


@pytest.fixture(scope="session")
def emulation_built() -> None:
    """Builds every module of this run in parallel up front (one g++ per core)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the CPU kernel emulation needs a C++17 compiler")
    if PLANTED_BUG is None:
        build_many((spec, cases.VARIANT) for spec in all_emulated_specs())


@pytest.fixture(scope="session")
def cpu_kernels():
    """The CPU kernels (backend/attention/cpu_kernel), built or taken from their cache; a build
    failure fails the test (g++ is part of this project's setup)."""
    from backend.attention.cpu_kernel import build

    try:
        return build.load_kernel()
    except build.KernelUnavailable as exc:  # pragma: no cover
        pytest.fail(f"the CPU kernels do not build here: {exc}")


@pytest.fixture(scope="session")
def cpu_kernels_avx2():
    """The same kernels built without AVX-512 (build.AVX2_ONLY_FLAGS): the paths an AVX2-only CPU runs
    (AVX2 decode and fused ops, no prefill kernel), tested here whatever the CI machine has."""
    import torch

    from backend.attention.cpu_kernel import build

    if not torch.cpu._is_avx2_supported():  # pragma: no cover (every x86-64 CI machine has AVX2)
        pytest.skip("this CPU has no AVX2")
    try:
        return build.CpuKernels(build.build_library(build.AVX2_ONLY_FLAGS))
    except build.KernelUnavailable as exc:  # pragma: no cover
        pytest.fail(f"the AVX2 build of the CPU kernels fails: {exc}")


def both_builds(request, native):
    """The fixture value for the parameter "native" (this CPU's build) or "avx2"."""
    return native if request.param == "native" else request.getfixturevalue("cpu_kernels_avx2")
