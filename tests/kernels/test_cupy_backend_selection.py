"""Where the cupy backend may run: cupy_available() and the errors of a backend built where it
cannot run. CuPy and CUDA are faked with monkeypatch, so every branch runs on any machine."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.attention import cupy_backend
from backend.attention.cupy_backend import CupyAttentionBackend, cupy_available
from kernels.build_options import paged_attention_spec
from kernels.nvrtc import cuda_include_dir

REPO = Path(__file__).resolve().parents[2]


def fake_cupy(device_count: int = 1, nvrtc_error: Exception | None = None) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "13.6.0"

    def get_version():
        if nvrtc_error is not None:
            raise nvrtc_error
        return (12, 9)

    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: device_count),
        nvrtc=types.SimpleNamespace(getVersion=get_version),
    )
    return cupy


def test_reports_missing_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    ok, reason = cupy_available()
    assert not ok and "CuPy is not importable" in reason and "cupy-cuda12x" in reason


def test_reports_missing_cuda_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cupy_available() == (False, "torch sees no CUDA device")


def test_reports_cupy_without_devices_or_nvrtc(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(device_count=0))
    assert cupy_available() == (False, "CuPy sees no CUDA device")
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(nvrtc_error=OSError("libnvrtc.so.12 not found")))
    ok, reason = cupy_available()
    assert not ok and "NVRTC" in reason and "libnvrtc.so.12" in reason


def test_available_with_cupy_and_a_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ok, reason = cupy_available()
    assert ok and "CuPy 13.6.0" in reason and "NVRTC 12.9" in reason


def test_building_the_backend_where_it_cannot_run_fails_clearly(monkeypatch):
    monkeypatch.setattr(cupy_backend, "cupy_available", lambda: (False, "torch sees no CUDA device"))
    with pytest.raises(
        RuntimeError, match="attention_backend=cupy cannot run here: torch sees no CUDA device"
    ):
        CupyAttentionBackend("cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CupyAttentionBackend("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_selector_refuses_cupy_without_a_gpu():
    selector = pytest.importorskip("backend.attention.selector")
    with pytest.raises((RuntimeError, ValueError), match="cupy"):
        selector.get_attention_backend("cupy", "cuda" if torch.cuda.is_available() else "cpu")
    assert selector.get_attention_backend("auto", "cpu").name in ("torch", "cpu")  # never cupy on the CPU


def test_engine_modules_import_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # as if CuPy were not installed
        "import backend.attention.cupy_backend, backend.attention.base\n"
        "assert sys.modules['cupy'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


class _Context:
    """A stand-in for cupy.cuda.Device / ExternalStream that records how it was entered."""

    log: list = []

    def __init__(self, *args):
        self.log.append((type(self).__name__, args))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cupy_launch_passes_tensors_over_dlpack_on_torchs_stream(monkeypatch):
    """The GPU-only launch path, against a fake CuPy: bf16 goes as its int16 bits (CuPy has no
    bfloat16), scalars pass through, the launch happens inside Device + ExternalStream(torch's)."""
    log = []
    device_cls = type("Device", (_Context,), {"log": log})
    stream_cls = type("ExternalStream", (_Context,), {"log": log})
    cupy = fake_cupy()
    cupy.cuda.Device, cupy.cuda.ExternalStream = device_cls, stream_cls
    cupy.from_dlpack = lambda t: ("dlpack", t.dtype, t.data_ptr())
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234)
    )
    half, bf16 = torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16)
    launched = {}

    def kernel(grid, block, args):
        launched.update(grid=grid, block=block, args=args, log=list(log))

    cupy_backend.cupy_launch(kernel, (2, 3, 1), (128,), (half, bf16, np.int32(7), np.float32(0.5)))
    assert launched["args"] == (
        ("dlpack", torch.float16, half.data_ptr()),
        ("dlpack", torch.int16, bf16.data_ptr()),
        np.int32(7),
        np.float32(0.5),
    )
    assert launched["log"] == [("Device", (None,)), ("ExternalStream", (1234,))]
    assert (launched["grid"], launched["block"]) == ((2, 3, 1), (128,))


def test_cupy_module_compiles_every_kernel_at_load_and_finds_cuda_headers(monkeypatch):
    """cupy_module against a fake CuPy whose NVRTC lacks cuda_fp16.h until -I is given."""
    built = []

    class RawModule:
        def __init__(self, code, options):
            assert '#include "common.cuh"' not in code  # self-contained source
            self.options = options
            built.append(options)

        def get_function(self, name):
            if not any(o.startswith("-I") for o in self.options):
                raise RuntimeError('catastrophic error: cannot open source file "cuda_fp16.h"')
            return name

    cupy = fake_cupy()
    cupy.RawModule = RawModule
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    spec = paged_attention_spec("bfloat16", 80)
    cupy_backend.cupy_module.cache_clear()
    try:
        module = cupy_backend.cupy_module(spec)
    finally:
        cupy_backend.cupy_module.cache_clear()
    assert built[0] == spec.options
    assert built[1][:-1] == spec.options and built[1][-1] == f"-I{cuda_include_dir()}"
    assert isinstance(module, RawModule)
