"""The fused CPU RMSNorm (with and without the residual add), SiLU x up, and rotary embedding +
KV-cache write against the torch ops the model runs otherwise (backend/models/llama.py with no
kernels): float32 within 1e-5 relative (summation order and a 2e-7 exp), bfloat16 identical except
where one float32 ulp flips a rounding (under 1% of elements; at most 2 bfloat16 ulps, since
RMSNorm rounds twice: the normed row, then its product with the weight). The rotary kernel does
the same products and sums as torch, each rounded alike, so it must match exactly in both dtypes."""

from __future__ import annotations

import pytest
import torch

from backend.attention.base import AttentionMetadata
from backend.models import cpu_fused
from backend.models.llama import LlamaMLP, RMSNorm
from backend.models.rope import RotaryEmbedding
from tests.kernels.conftest import both_builds


@pytest.fixture(params=["native", "avx2"])
def kernels(request, cpu_kernels):
    """This CPU's build and the build without AVX-512 (tests/kernels/conftest.py)."""
    return both_builds(request, cpu_kernels)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128, 36])  # 36: a half of 18 leaves a remainder for the plain loop
def test_rope_and_cache_write_equal_torchs_rotary_and_index_copy(kernels, dtype, head_size):
    num_heads, num_kv_heads, block_size, num_blocks = 9, 3, 16, 6
    g = torch.Generator().manual_seed(head_size)
    rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, head_size, dtype, torch.device("cpu"),
                             initial_len=512)
    num_tokens = 7
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g) * 2).to(dtype)
    positions = torch.tensor([0, 1, 5, 100, 300, 511, 17], dtype=torch.int64)
    slots = torch.tensor([3, 20, -1, 33, 60, 95, 16], dtype=torch.int64)  # -1: this token is not written
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = torch.full(cache_shape, 5.0, dtype=dtype), torch.full(cache_shape, 5.0, dtype=dtype)

    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qk = qkv[:, : q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_size)
    want_qk = rotary(positions, qk)  # the model's torch path
    want_q, want_k = want_qk[:, :num_heads], want_qk[:, num_heads:]
    want_v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    want_key_cache, want_value_cache = key_cache.clone(), value_cache.clone()
    written = slots >= 0
    want_key_cache.view(-1, num_kv_heads, head_size)[slots[written]] = want_k[written]
    want_value_cache.view(-1, num_kv_heads, head_size)[slots[written]] = want_v[written]

    q, k = cpu_fused.rope_cache(kernels, qkv, positions, rotary.cos_sin_cache, key_cache, value_cache, slots,
                                num_heads)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(key_cache, want_key_cache) and torch.equal(value_cache, want_value_cache)


def test_the_attention_layer_with_the_rope_kernel_equals_the_torch_path(kernels):
    """LlamaAttention with kernels set: rotary + cache write fused, the backend told the cache is
    written; same output and same cache as the torch path."""
    from backend.attention.torch_backend import TorchAttentionBackend
    from backend.models.llama import LlamaAttention

    class Config:
        hidden_size, num_attention_heads, num_key_value_heads, head_dim = 64, 4, 2, 16
        num_hidden_layers, intermediate_size, vocab_size = 1, 128, 100

    torch.manual_seed(0)
    layer = LlamaAttention(Config, TorchAttentionBackend("cpu"), qkv_bias=False, o_bias=False)
    for linear in (layer.qkv_proj, layer.o_proj):
        torch.nn.init.normal_(linear.weight, std=0.2)
    rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, 16, torch.float32, torch.device("cpu"))
    hidden, positions = torch.randn(5, 64), torch.tensor([0, 1, 2, 0, 1], dtype=torch.int64)
    metadata = AttentionMetadata.build(torch.tensor([8, 9, 10, 4, 5], dtype=torch.int64),
                                       torch.tensor([[2], [1]], dtype=torch.int32), [3, 2], [3, 2])
    results = []
    for kernels_set in (None, kernels):
        layer.kernels = kernels_set
        caches = (torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16))
        results.append((layer(hidden, rotary, positions, caches, metadata), caches))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(results[1][1][0], results[0][1][0]) and torch.equal(results[1][1][1], results[0][1][1])
