"""The kernels compile for sm_80 and sm_90 with NVRTC (every option combination the backend
uses) and with nvcc (where installed), within register, shared-memory and spill limits.

NVRTC runs from the nvidia-cuda-nvrtc-cu12 wheel through ctypes: no GPU or driver needed. Results
are cached under build/kernels/compile by a hash of the sources, options and compiler version.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import KERNEL_DIR, nvcc, nvrtc, ptxas_info
from kernels.build_options import (
    NUM_THREADS,
    ModuleSpec,
    all_specs,
    paged_attention_spec,
    reshape_and_cache_spec,
)

ARCHS = ("sm_80", "sm_90")
# Limits per kernel. Registers: <= 96 keeps >= 5 blocks of NUM_THREADS threads per SM (64K
# registers); shared memory: static declarations, well under the 48 KiB a block may declare
# statically, so several blocks share an SM; no spills and no stack (local memory traffic).
MAX_REGISTERS = 96
MAX_SHARED_BYTES = 24 * 1024
CACHE_DIR = Path(os.environ.get("KERNEL_BUILD_DIR", KERNEL_DIR.parent / "build" / "kernels")) / "compile"
# nvcc is slow (~3 s a module), and NVRTC already covers every combination: nvcc builds the 16-bit
# types with a head size whose chunks divide evenly among a thread group (128) and one that does
# not (80), and a cache writer.
NVCC_SPECS = [paged_attention_spec(d, hs) for d in ("float16", "bfloat16") for hs in (80, 128)]
NVCC_SPECS.append(reshape_and_cache_spec("bfloat16"))


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    for header in sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(header.read_bytes())
    return h.hexdigest()[:24]


def _cached(name: str, produce) -> str:
    path = CACHE_DIR / f"{name}.log"
    if path.exists():
        return path.read_text()
    text = produce()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return text


def _nvrtc_log(spec: ModuleSpec, arch: str) -> str:
    def produce() -> str:
        return nvrtc.compile_source(spec.code(), spec.options, arch, name=spec.source).log

    return _cached(f"nvrtc-{arch}-{_key(nvrtc.version(), spec.code(), *spec.options, arch)}", produce)


def _nvcc_log(spec: ModuleSpec) -> str:
    key = _key(nvcc.version(), spec.code(), *spec.options, *ARCHS)
    return _cached(f"nvcc-{key}", lambda: nvcc.compile_fatbin(spec, ARCHS, CACHE_DIR / f"nvcc-{key}.fatbin"))


def _spec_id(spec: ModuleSpec) -> str:
    return f"{Path(spec.source).stem}-" + "-".join(
        o[2:].split("=")[1] for o in spec.options if o.startswith("-D")
    )


def _check_limits(resources: ptxas_info.KernelResources, where: str) -> None:
    assert resources.registers <= MAX_REGISTERS, f"{where}: {resources.registers} registers"
    assert resources.shared_bytes <= MAX_SHARED_BYTES, (
        f"{where}: {resources.shared_bytes} bytes of shared memory"
    )
    assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0, (
        f"{where}: spills {resources}"
    )
    assert resources.stack_bytes == 0, f"{where}: {resources.stack_bytes} bytes of stack"


@pytest.fixture(scope="module")
def nvrtc_logs() -> dict[tuple[ModuleSpec, str], str]:
    ok, why = nvrtc.available()
    if not ok:
        pytest.skip(f"NVRTC unavailable ({why}); pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12")
    jobs = [(spec, arch) for spec in all_specs() for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # ctypes drops the GIL
        logs = list(pool.map(lambda job: _nvrtc_log(*job), jobs))
    return dict(zip(jobs, logs, strict=True))


@pytest.fixture(scope="module")
def nvcc_logs() -> dict[ModuleSpec, str]:
    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found: the fatbin build runs where the CUDA toolkit is installed (CI has it)")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        logs = list(pool.map(_nvcc_log, NVCC_SPECS))
    return dict(zip(NVCC_SPECS, logs, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", all_specs(), ids=_spec_id)
def test_nvrtc_compiles_within_limits(nvrtc_logs, spec: ModuleSpec, arch: str):
    resources = ptxas_info.parse(nvrtc_logs[(spec, arch)])
    assert {name for name, _ in resources} == set(spec.kernel_names), resources
    for (name, found_arch), r in resources.items():
        assert found_arch == arch
        _check_limits(r, f"NVRTC {arch} {_spec_id(spec)} {name}")


@pytest.mark.parametrize("spec", NVCC_SPECS, ids=_spec_id)
def test_nvcc_builds_fatbin_within_limits(nvcc_logs, spec: ModuleSpec):
    resources = ptxas_info.parse(nvcc_logs[spec])
    assert set(resources) == {(name, arch) for name in spec.kernel_names for arch in ARCHS}, resources
    for (name, arch), r in resources.items():
        _check_limits(r, f"nvcc {arch} {_spec_id(spec)} {name}")


def test_nvrtc_rejects_what_nvcc_accepts():
    """Why both compilers run: INFINITY (math.h) builds with nvcc but not with NVRTC."""
    ok, why = nvrtc.available()
    if not ok:
        pytest.skip(f"NVRTC unavailable ({why})")
    code = 'extern "C" __global__ void k(float* out) { out[0] = -INFINITY; }\n'
    with pytest.raises(nvrtc.NvrtcError, match="INFINITY"):
        nvrtc.compile_source(code, (), "sm_80")


def test_block_size_matches_the_backend():
    """The kernels are compiled for exactly the block size the backend launches."""
    assert f"-DNUM_THREADS={NUM_THREADS}" in paged_attention_spec("float16", 128).options
