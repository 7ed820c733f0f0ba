"""The CPU paged prefill kernel (backend/attention/cpu_kernel/paged_prefill.cpp) against the reference.

Prompt chunks with and without a cached prefix, in one batch with decodes (which the kernel must
leave alone), over shuffled block tables whose unused slots hold NaN: a read outside a sequence's
context turns its rows into NaN. The kernel reads every K/V from the cache, so the step's own K/V
are written first, as the model does. Tolerances against the float32 reference: float32 within
5e-5 (summation order over contexts up to 4k), bfloat16 within 3e-2 (the bfloat16 output's own
rounding, plus P rounded to bfloat16 before the product with V, as torch's flash attention does).
"""

from __future__ import annotations

import pytest
import torch

from backend.attention.cpu_backend import AMX_SDPA_MIN_QUERY_LEN, CpuAttentionBackend, paged_prefill
from backend.attention.torch_backend import TorchAttentionBackend
from tests.kernels import reference
from tests.kernels.batches import expected_output, make_batch

TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 3e-2}
HEADS = [(4, 4), (9, 3), (8, 2), (16, 2)]  # GQA ratios 1, 3, 4, 8


@pytest.fixture()
def kernel(cpu_kernels):
    if not cpu_kernels.prefill_available:
        pytest.skip("this build has no AVX-512: prefill stays on torch's SDPA (tested by the backend tests)")
    return cpu_kernels


def prefill_and_compare(kernel, seq_lens, query_lens, heads, head_size, dtype, block_size=16, seed=0):
    num_heads, num_kv_heads = heads
    batch = make_batch(seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, dtype=dtype, seed=seed)
    scale = head_size ** -0.5
    expected, key_cache, value_cache = expected_output(batch, scale)
    md = batch.metadata
    out = torch.full_like(batch.query, 7.0)  # decode rows must stay untouched
    paged_prefill(kernel, batch.query, key_cache, value_cache, md, scale, out)
    decode_rows = md.num_decodes
    assert (out[:decode_rows] == 7.0).all()
    got = out[decode_rows:].float()
    assert not torch.isnan(got).any()
    error = (got - expected[decode_rows:]).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_prompts_with_and_without_a_cached_prefix_equal_the_reference(kernel, heads, head_size, dtype):
    # whole prompts (2, 17 and 40 tokens), chunks after a prefix (partial blocks on both sides), and decodes
    prefill_and_compare(kernel, [2, 17, 40, 100, 333, 9, 50], [2, 17, 40, 30, 5, 1, 1], heads, head_size, dtype,
                        seed=head_size + heads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_up_to_4k(kernel, dtype):
    prefill_and_compare(kernel, [4096, 2100, 600], [70, 2100, 33], (8, 2), 128, dtype, seed=4)


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_other_block_sizes(kernel, block_size, dtype):
    prefill_and_compare(kernel, [31, 64, 95], [31, 20, 3], (9, 3), 64, dtype, block_size=block_size, seed=block_size)


def test_a_head_size_of_48_takes_the_float32_path_for_bfloat16(kernel):
    """48 is a multiple of 16 (the kernel's demand) but not of 32 (vdpbf16ps's pairs of 16)."""
    prefill_and_compare(kernel, [40, 70], [40, 18], (6, 2), 48, torch.bfloat16, seed=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_backend_equals_the_torch_backend_on_a_mixed_step(kernel, dtype):
    """The whole forward (cache write, decodes, prefills with and without a prefix) against the torch
    backend's SDPA path on the same inputs."""
    batch = make_batch([40, 1, 250, 90, 64], [1, 1, 1, 30, 64], num_heads=9, num_kv_heads=3, head_size=64,
                       block_size=16, dtype=dtype, seed=12, fill=0.0)
    outputs = []
    for backend in (TorchAttentionBackend("cpu"), CpuAttentionBackend(kernel)):
        key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
        outputs.append(backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache,
                                       batch.metadata, 0.125))
    error = (outputs[0].float() - outputs[1].float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_bfloat16_chunks_go_to_sdpa_and_the_rest_to_the_kernel(kernel, monkeypatch, dtype):
    """With a threshold (on AMX CPUs AMX_SDPA_MIN_QUERY_LEN), bfloat16 chunks at least that long go to
    SDPA, whole prompts and chunks after a prefix alike, and each run of shorter chunks between them
    to the kernel in one call; float32 keeps every chunk on the kernel. Equal to the reference."""
    calls = []
    kernel_prefill = kernel.paged_prefill
    monkeypatch.setattr(kernel, "paged_prefill", lambda *args: calls.append(args[8:10]) or kernel_prefill(*args))
    # decodes, then chunks of 12 and 17 tokens (kernel), 64 (SDPA), 30 after a prefix (SDPA), 9 and 25 (kernel)
    batch = make_batch([40, 70, 12, 17, 64, 130, 9, 25], [1, 1, 12, 17, 64, 30, 9, 25], num_heads=9,
                       num_kv_heads=3, head_size=64, block_size=16, dtype=dtype, seed=21, fill=0.0)
    expected, _, _ = expected_output(batch, 0.125)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    backend = CpuAttentionBackend(kernel, sdpa_min_query_len=26)
    out = backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache, batch.metadata, 0.125)
    assert calls == ([(2, 4), (6, 8)] if dtype == torch.bfloat16 else [(2, 8)])
    error = (out.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"


def test_the_sdpa_threshold_follows_the_cpu(kernel):
    """The "auto" threshold sends long bfloat16 chunks to SDPA exactly where torch reports AMX tiles."""
    amx = torch.cpu._is_amx_tile_supported()
    assert CpuAttentionBackend(kernel).sdpa_min_query_len == (AMX_SDPA_MIN_QUERY_LEN if amx else None)


def test_a_head_size_the_kernel_does_not_take_goes_to_sdpa(kernel):
    """Head size 36 (not a multiple of 16): the backend plans SDPA's masks after all and agrees with
    the reference."""
    batch = make_batch([30, 50], [30, 12], num_heads=4, num_kv_heads=2, head_size=36, block_size=16,
                       dtype=torch.float32, seed=36, fill=0.0)
    expected, _, _ = expected_output(batch, 36 ** -0.5)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    out = CpuAttentionBackend(kernel).forward(batch.query, batch.key, batch.value, key_cache, value_cache,
                                              batch.metadata, 36 ** -0.5)
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[torch.float32]


def test_the_reference_itself_is_causal():
    """A guard on the yardstick: the reference's first prompt row sees only key 0."""
    batch = make_batch([5], [5], num_heads=2, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.float32,
                       seed=1, fill=0.0)
    expected, key_cache, value_cache = expected_output(batch, 0.25)
    first_value = value_cache.view(-1, 2, 16)[int(batch.metadata.slot_mapping[0])]
    torch.testing.assert_close(expected[0], first_value.float())
    assert reference is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_build_without_avx512_prefills_through_sdpa(cpu_kernels_avx2, dtype):
    """An AVX2-only build has no prefill kernel: the backend plans SDPA's masks and still equals the
    torch backend, decodes through the AVX2 kernel."""
    assert not cpu_kernels_avx2.prefill_available
    batch = make_batch([40, 1, 250, 90, 64], [1, 1, 1, 30, 64], num_heads=9, num_kv_heads=3, head_size=64,
                       block_size=16, dtype=dtype, seed=13, fill=0.0)
    outputs = []
    for backend in (TorchAttentionBackend("cpu"), CpuAttentionBackend(cpu_kernels_avx2)):
        key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
        outputs.append(backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache,
                                       batch.metadata, 0.125))
    error = (outputs[0].float() - outputs[1].float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"
