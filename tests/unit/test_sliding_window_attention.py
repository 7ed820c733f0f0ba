"""Sliding-window attention (``forward(..., sliding_window=W)``) on every backend against a dense
float32 reference: query i attends keys i - W < j <= i (transformers' ``sliding_window_overlay``).

Backends: torch, the CPU kernels (this CPU's build and the AVX2-only one) and the CUDA kernels on the
CPU emulation (kernels/emulation). Cache slots no query may attend are poisoned before the step:
whole blocks before the one holding the earliest attended position with NaN (they must not be read),
that block's earlier positions with key 0 and value 1000 (a backend may read them, but any weight on
them, which an ordinary score of 0 would give, shows in the output).
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from backend.attention.cpu_backend import CpuAttentionBackend
from backend.attention.cupy_backend import CupyAttentionBackend
from backend.attention.torch_backend import TorchAttentionBackend
from tests.kernels import reference
from tests.kernels.batches import Batch, make_batch

HEAD_SIZE = 64
PARTITION_SIZE = 64  # the emulated CUDA decode's partition: windows over 64 tokens use the reduce kernel
TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 3e-2}
FP32, BF16 = torch.float32, torch.bfloat16
# (backend, dtype); the emulated CUDA kernels run float32 (their window logic does not depend on it)
COMBOS = [("torch", FP32), ("torch", BF16), ("cpu", FP32), ("cpu", BF16), ("cpu_avx2", FP32), ("cpu_avx2", BF16),
          ("cupy", FP32)]


@functools.cache
def _cpu_kernels(avx2_only: bool):
    from backend.attention.cpu_kernel import build  # noqa: PLC0415

    try:
        return build.CpuKernels(build.build_library(build.AVX2_ONLY_FLAGS)) if avx2_only else build.load_kernel()
    except build.KernelUnavailable as exc:  # pragma: no cover (g++ is part of the setup)
        pytest.fail(f"the CPU kernels do not build here: {exc}")


def make_backend(name: str, dtype: torch.dtype):
    if name == "torch":
        return TorchAttentionBackend("cpu")
    if shutil.which("g++") is None:  # pragma: no cover
        pytest.skip("g++ not found: the CPU kernels and the CUDA emulation need it")
    if name == "cupy":
        from tests.kernels.conftest import emulated_launch, emulated_module  # noqa: PLC0415

        return CupyAttentionBackend("cpu", head_size=HEAD_SIZE, dtype=dtype, partition_size=PARTITION_SIZE,
                                    module_factory=emulated_module, launch=emulated_launch)
    if name == "cpu_avx2" and not torch.cpu._is_avx2_supported():  # pragma: no cover
        pytest.skip("this CPU has no AVX2")
    return CpuAttentionBackend(_cpu_kernels(name == "cpu_avx2"))


@pytest.fixture(params=COMBOS, ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}")
def combo(request):
    """(backend name, dtype)."""
    return request.param


def window_mask(positions: torch.Tensor, context_len: int, window: int | None) -> torch.Tensor:
    """[len(positions), context_len] bool: query at position i sees key j (causal, within the window)."""
    keys = torch.arange(context_len)[None, :]
    allowed = keys <= positions[:, None]
    if window:
        allowed &= keys > positions[:, None] - window
    return allowed


def dense_reference(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """[num_tokens, num_heads, head_size] float32: plain softmax over explicit positions, the cache
    after this step's writes, gathered position by position."""
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    reference.write_cache(batch.key, batch.value, key_cache, value_cache, batch.metadata.slot_mapping)
    num_heads = batch.query.shape[1]
    out, start = [], 0
    for i, (seq_len, q_len) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        table = batch.metadata.block_tables[i]
        k = reference.gather_context(key_cache, table, seq_len)  # [seq_len, num_kv_heads, head_size]
        v = reference.gather_context(value_cache, table, seq_len)
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = batch.query[start : start + q_len].float() * scale  # [q_len, num_heads, head_size]
        logits = torch.einsum("qhd,khd->hqk", q, k)
        allowed = window_mask(torch.arange(seq_len - q_len, seq_len), seq_len, window)
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q_len
    return torch.cat(out)


def poison_outside_windows(batch: Batch, window: int) -> None:
    """Poisons (module docstring) the cached positions before each sequence's earliest attended one
    (its first new token's window start)."""
    block_size = batch.key_cache.shape[1]
    for i, (seq_len, q_len) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        earliest = max(0, seq_len - q_len - window + 1)
        for t in range(earliest):
            block = int(batch.metadata.block_tables[i, t // block_size])
            whole_block = t < earliest // block_size * block_size
            batch.key_cache[block, t % block_size] = float("nan") if whole_block else 0.0
            batch.value_cache[block, t % block_size] = float("nan") if whole_block else 1000.0


def run_and_compare(combo, seq_lens, query_lens, window, heads=(8, 2), block_size=16, seed=0, head_size=HEAD_SIZE):
    """One forward with ``sliding_window=window`` over a poisoned cache, checked against the reference."""
    name, dtype = combo
    num_heads, num_kv_heads = heads
    # the torch decode gathers padding blocks (the null block): NaN there would poison it under its mask
    batch = make_batch(seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, dtype=dtype, seed=seed, fill=0.0 if name == "torch" else float("nan"))
    scale = head_size**-0.5
    expected = dense_reference(batch, scale, window)
    if window:
        poison_outside_windows(batch, window)
    backend = make_backend(name, dtype)
    out = backend.forward(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata,
                          scale, sliding_window=window)
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert not out.isnan().any(), "a slot outside every window was read"
    error = (out.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"
    return out


def test_the_reference_mask_is_transformers_sliding_window_mask():
    mask_function = sliding_window_causal_mask_function(5)
    positions = torch.arange(3, 12)
    ours = window_mask(positions, 12, 5)
    theirs = mask_function(torch.tensor(0), torch.tensor(0), positions[:, None], torch.arange(12)[None, :])
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("window", [16, 20])  # a multiple of the block size, and not
def test_decodes_shorter_than_equal_to_and_longer_than_the_window(combo, window):
    run_and_compare(combo, [5, 19, 20, 21, 37, 100, 16, 17, 64], [1] * 9, window, seed=window)


def test_prefill_chunks_with_and_without_a_cached_prefix_across_the_window_edge(combo):
    # no prefix: longer than the window (banded mask) and shorter (causal); with a prefix: shorter
    # than the window, and chunks whose first window starts mid-block, on a block edge, past it
    run_and_compare(combo, [50, 12, 30, 90, 45, 68, 100], [50, 12, 12, 30, 10, 33, 3], 20, seed=1)


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_a_mixed_batch_of_decodes_and_prefill_chunks(combo, heads):
    run_and_compare(combo, [40, 1, 250, 90, 33, 70, 24], [1, 1, 1, 30, 33, 70, 1], 24, heads=heads, seed=heads[0])


@pytest.mark.parametrize("window", [100, 600])
def test_long_contexts_over_several_kernel_partitions(combo, window):
    # the CPU decode splits contexts into 512-token partitions, the emulated CUDA one into 64
    run_and_compare(combo, [1300, 700, 513, 30, 600], [1, 1, 1, 1, 100], window, seed=window)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(combo, block_size):
    run_and_compare(combo, [13, 14, 50, 97, 40, 60], [1, 1, 1, 1, 40, 25], 13, block_size=block_size,
                    seed=block_size)


def test_a_head_size_off_the_vector_paths(combo):
    """Head size 36: the CPU decode's plain loops, torch's SDPA for the prefill chunks."""
    if combo[0] == "cupy":
        pytest.skip("the CUDA kernels take head sizes that are a multiple of 8")
    run_and_compare(combo, [13, 30, 77, 40, 60], [1, 1, 1, 40, 25], 20, heads=(9, 3), head_size=36, seed=36)


def test_no_window_is_full_causal_attention_bit_for_bit(combo):
    name, dtype = combo
    batch = make_batch([40, 1, 250, 90, 33], [1, 1, 1, 30, 33], num_heads=8, num_kv_heads=2, head_size=HEAD_SIZE,
                       block_size=16, dtype=dtype, seed=3, fill=0.0 if name == "torch" else float("nan"))
    expected = dense_reference(batch, 0.125, None)
    outputs = []
    # no argument (every caller before sliding windows), None, 0, and windows no context outgrows
    for kwargs in ({}, {"sliding_window": None}, {"sliding_window": 0}, {"sliding_window": 250},
                   {"sliding_window": 4096}):
        backend = make_backend(name, dtype)
        key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
        outputs.append(backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache, batch.metadata,
                                       0.125, **kwargs))
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])
    assert (outputs[0].float() - expected).abs().max().item() <= TOLERANCE[dtype]


def test_sliding_and_global_layers_in_one_step_plan_once_per_window(combo, monkeypatch):
    name, dtype = combo
    batch = make_batch([40, 1, 250, 90, 33], [1, 1, 1, 30, 33], num_heads=8, num_kv_heads=2, head_size=HEAD_SIZE,
                       block_size=16, dtype=dtype, seed=4, fill=0.0 if name == "torch" else float("nan"))
    scale = HEAD_SIZE**-0.5
    expected = {window: dense_reference(batch, scale, window) for window in (24, None, 7)}
    backend = make_backend(name, dtype)
    planned, plan_step = [], backend.plan_step

    def counted_plan_step(metadata, block_size, dtype, window=0):
        planned.append(window)
        return plan_step(metadata, block_size, dtype, window)

    monkeypatch.setattr(backend, "plan_step", counted_plan_step)
    outputs = {}
    for window in (24, None, 24, 7, None, 7):  # layers alternate; the cache write repeats the same K/V
        out = backend.forward(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata,
                              scale, sliding_window=window)
        if window in outputs:
            assert torch.equal(out, outputs[window])
        outputs[window] = out
        error = (out.float() - expected[window]).abs().max().item()
        assert error <= TOLERANCE[dtype], f"window {window}: max error {error:.3g}"
    assert planned == [24, 0, 7]


def test_a_negative_window_is_refused():
    batch = make_batch([5], [1], num_heads=2, num_kv_heads=1, head_size=HEAD_SIZE, block_size=16, dtype=FP32,
                       fill=0.0)
    with pytest.raises(ValueError, match="sliding_window"):
        TorchAttentionBackend("cpu").forward(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache,
                                             batch.metadata, 0.125, sliding_window=-4)
