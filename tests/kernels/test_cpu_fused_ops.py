"""The fused CPU RMSNorm (with and without the residual add) and SiLU x up against the torch ops
the model runs otherwise (backend/models/llama.py with no kernels): float32 within 1e-5 relative
(summation order and a 2e-7 exp), bfloat16 identical except where one float32 ulp flips a
rounding (under 1% of elements; at most 2 bfloat16 ulps, since RMSNorm rounds twice: the normed
row, then its product with the weight)."""

from __future__ import annotations

import pytest
import torch

from backend.models import cpu_fused
from backend.models.llama import LlamaMLP, RMSNorm


@pytest.fixture()
def kernels(cpu_kernels):
    return cpu_kernels


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    differ = got != want
    assert differ.float().mean().item() < 0.01, f"{int(differ.sum())} of {want.numel()} elements differ"
    ulp = (want.float().abs() * 2**-7).clamp_min(1e-30)  # one bfloat16 ulp (8 mantissa bits) or more
    assert ((got.float() - want.float()).abs() <= 2 * ulp * 1.01).all()


def norm_module(hidden: int, dtype: torch.dtype, kernels=None) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)) * 0.2 + 1)
    norm = norm.to(dtype)
    norm.kernels = kernels
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_with_and_without_residual_equals_torch(kernels, dtype, rows):
    hidden = 576
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    reference, fused = norm_module(hidden, dtype), norm_module(hidden, dtype, kernels)
    assert_close(fused(x), reference(x))
    want_out, want_residual = reference(x, residual.clone())
    fused_residual = residual.clone()
    got_out, got_residual = fused(x, fused_residual)
    assert got_residual is fused_residual  # updated in place: residual + x
    assert_close(got_residual, want_residual)
    assert_close(got_out, want_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1536, 13])  # a multiple of 8, and a remainder the vector loop leaves
def test_silu_mul_equals_torch(kernels, dtype, width):
    g = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(9, 2 * width, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps
    gate, up = gate_up[:, :width], gate_up[:, width:]
    want = torch.nn.functional.silu(gate) * up
    assert_close(cpu_fused.silu_mul(kernels, gate_up), want)


def test_the_mlp_uses_the_kernel_and_gives_torchs_result(kernels):
    class Config:
        hidden_size, intermediate_size = 64, 96

    mlp = LlamaMLP(Config, bias=False)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        torch.nn.init.normal_(linear.weight, std=0.1)
    x = torch.randn(5, 64)
    want = mlp(x)
    mlp.kernels = kernels
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)


def test_what_the_kernels_do_not_take_goes_through_torch(kernels):
    norm = norm_module(32, torch.float16, kernels)
    x = torch.randn(3, 32).half()
    assert not cpu_fused.takes(x, norm.weight) or x.dtype != torch.float16
    assert norm(x).dtype == torch.float16  # fell back to torch's ops
    strided = torch.randn(3, 64)[:, ::2]
    assert not cpu_fused.takes(strided)
