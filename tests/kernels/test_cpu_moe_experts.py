"""A sparse MLP's experts through the CPU kernel (``moe_experts``, backend/models/moe_cpu.py), this
CPU's build and the AVX2-only one, against the torch path of the same block (one GEMM pair per
expert): float32 within 1e-5 relative (summation order and a 2e-7 exp), bfloat16 with under 2% of
elements a rounding apart (the GEMMs' sums run in another order, so a rounding of gate or up can
flip and carry through). Shapes with remainders everywhere (hidden 70: a partial 64-column down
block and vector tails; intermediate 45: a zero-padded gate_up block; hidden 33: an odd depth),
experts nobody chose, top-3,
a strided input, Mixtral's float32 router weights in a bfloat16 model and a shared expert. Where the
build has AVX512_BF16, bfloat16 weights are packed in depth pairs (vdpbf16ps), so the native build
tests that layout and the AVX2 build the plain one."""

from __future__ import annotations

import pytest
import torch

from backend.models.family import MoeSpec
from backend.models.llama import LlamaMLP
from backend.models.moe import SparseMoeBlock
from backend.models.moe_cpu import BF16_MAX_TOKENS, pack_down, pack_gate_up
from tests.kernels.conftest import both_builds

SHAPES = {  # (num_experts, hidden, intermediate, top_k)
    "smollm2_like": (8, 576, 768, 2),
    "remainders": (6, 70, 45, 3),
    "odd_hidden": (4, 33, 20, 2),  # an odd depth: vdpbf16ps's last pair is half padding
}


@pytest.fixture(params=["native", "avx2"])
def kernels(request, cpu_kernels):
    """This CPU's build and the build without AVX-512 (tests/kernels/conftest.py)."""
    return both_builds(request, cpu_kernels)


def block_for(shape: str, dtype: torch.dtype, seed: int = 0, weights_in_model_dtype: bool = True,
              shared: bool = False) -> SparseMoeBlock:
    experts, hidden, inter, top_k = SHAPES[shape]
    torch.manual_seed(seed)
    shared_expert = LlamaMLP(_Config(hidden, 2 * inter), bias=False) if shared else None
    block = SparseMoeBlock(hidden, MoeSpec(experts, top_k, inter, True, weights_in_model_dtype), "silu", shared_expert)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.1)
    block = block.to(dtype)
    block.prepack()
    return block


class _Config:  # what LlamaMLP reads of a transformers config
    def __init__(self, hidden_size: int, intermediate_size: int):
        self.hidden_size, self.intermediate_size, self.hidden_act = hidden_size, intermediate_size, "silu"


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        return
    differ = got != want
    assert differ.float().mean().item() < 0.02, f"{int(differ.sum())} of {want.numel()} elements differ"
    scale = want.float().abs().max().item()
    assert ((got.float() - want.float()).abs() <= scale * 2**-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_the_kernel_equals_the_torch_path(kernels, dtype, shape, num_tokens):
    block = block_for(shape, dtype)
    x = torch.randn(num_tokens, SHAPES[shape][1]).to(dtype)
    with torch.inference_mode():
        want = block(x)
        assert block.use_kernels(kernels) and block.cpu_experts.takes(x)
        got = block(x)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_nobody_chose_a_strided_input_and_a_shared_expert(kernels, dtype):
    block = block_for("remainders", dtype, seed=3, shared=True)
    with torch.no_grad():  # the router prefers experts 0-2 by far: the others get no rows
        block.gate.weight.zero_()
        block.gate.weight[:3] = 1.0
        block.prepack()
    wide = torch.randn(9, 3 * 70).to(dtype)
    x = wide[:, 70:140].abs()  # a strided view, rows 210 apart
    with torch.inference_mode():
        weights, experts = block.route(x)
        assert set(experts.flatten().tolist()) == {0, 1, 2}
        want = block(x.contiguous())
        block.use_kernels(kernels)
        got = block(x)
    assert_close(got, want)


def test_mixtrals_float32_router_weights_in_a_bfloat16_model(kernels):
    block = block_for("remainders", torch.bfloat16, seed=5, weights_in_model_dtype=False)
    x = torch.randn(11, 70).to(torch.bfloat16)
    with torch.inference_mode():
        want = block(x)
        block.use_kernels(kernels)
        got = block(x)
    assert_close(got, want)


def test_which_steps_and_copies_the_kernel_takes(kernels):
    fp32 = block_for("remainders", torch.float32)
    assert fp32.use_kernels(kernels) and fp32.packed is None  # float32: the kernel serves every step
    assert fp32.cpu_experts.takes(torch.randn(4096, 70))
    bf16 = block_for("remainders", torch.bfloat16)
    packed = bf16.packed is not None
    assert bf16.use_kernels(kernels)
    x = torch.randn(BF16_MAX_TOKENS + 1, 70).to(torch.bfloat16)
    if kernels.moe_experts_bf16_pairs():  # vdpbf16ps: every step, oneDNN's copies dropped
        assert bf16.packed is None and bf16.cpu_experts.takes(x)
    else:  # float32 multiplies: oneDNN keeps the longer steps
        assert (bf16.packed is not None) == packed
        assert bf16.cpu_experts.takes(x[:BF16_MAX_TOKENS]) and not bf16.cpu_experts.takes(x)
        with torch.inference_mode():
            torch.testing.assert_close(bf16(x), SparseMoeBlock.forward(_without_kernel(bf16), x), rtol=0, atol=0)
    gelu = SparseMoeBlock(70, MoeSpec(6, 3, 45, True, True), "gelu_pytorch_tanh")
    assert not gelu.use_kernels(kernels) and gelu.cpu_experts is None  # only the SiLU gate is in the kernel


def _without_kernel(block: SparseMoeBlock) -> SparseMoeBlock:
    block.cpu_experts = None
    return block


def test_the_packed_layouts():
    gate_up = torch.arange(2 * 90 * 5, dtype=torch.float32).view(2, 90, 5)  # [E, 2I, H], I = 45
    packed = pack_gate_up(gate_up)  # [E, 2 blocks, H, 64]
    assert packed.shape == (2, 2, 5, 64)
    assert packed[1, 1, 4, 3].item() == gate_up[1, 32 + 3, 4].item()  # block 1's gate column 3
    assert packed[1, 1, 4, 32 + 3].item() == gate_up[1, 45 + 32 + 3, 4].item()  # and its up column
    assert (packed[:, 1, :, 13:32] == 0).all() and (packed[:, 1, :, 32 + 13:] == 0).all()  # padding
    down = torch.randn(2, 70, 45)  # [E, H, I]
    packed_down = pack_down(down, 64)  # [E, 2 blocks, I_pad, 64]
    assert packed_down.shape == (2, 2, 64, 64)
    assert packed_down[1, 1, 44, 5].item() == down[1, 64 + 5, 44].item()
    assert (packed_down[:, :, 45:] == 0).all() and (packed_down[:, 1, :, 6:] == 0).all()
    paired = pack_gate_up(gate_up, pairs=True)  # [E, 2 blocks, ceil(H / 2), 64, 2]: vdpbf16ps's layout
    assert paired.shape == (2, 2, 3, 64, 2)
    assert paired[1, 1, 1, 3, 1].item() == packed[1, 1, 3, 3].item()  # depth 3 = pair 1, second half
    assert (paired[:, :, 2, :, 1] == 0).all()  # H = 5 is odd: the last pair's second half is zero
    assert pack_down(down, 64, pairs=True).shape == (2, 2, 32, 64, 2)
