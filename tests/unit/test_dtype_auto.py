"""``dtype: auto`` on the CPU follows the CPU's bfloat16 support (backend/models/loader.py), because
bfloat16 GEMMs are 1.8x faster than float32 with AVX512_BF16 here and 3.2x slower when emulated."""

from __future__ import annotations

import pytest
import torch

from backend.models import loader


class Config:
    torch_dtype = "bfloat16"


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"), [
    (True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32)])
def test_auto_picks_bfloat16_only_where_the_cpu_has_it(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert loader.resolve_dtype("auto", Config(), torch.device("cpu")) == expected


def test_an_explicit_dtype_is_kept_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert loader.resolve_dtype("bfloat16", Config(), torch.device("cpu")) == torch.bfloat16
    assert loader.resolve_dtype("float32", Config(), torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        loader.resolve_dtype("int8", Config(), torch.device("cpu"))


def test_without_torchs_probes_the_kernel_flags_decide(monkeypatch, tmp_path):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            return real_open(tmp_path / "cpuinfo", *args, **kwargs)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    (tmp_path / "cpuinfo").write_text("flags : fpu avx2 fma avx512f\n")
    assert not loader.cpu_has_native_bfloat16()
    (tmp_path / "cpuinfo").write_text("flags : fpu avx2 fma avx512f avx512_bf16\n")
    assert loader.cpu_has_native_bfloat16()
