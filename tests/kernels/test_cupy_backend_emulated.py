"""CupyAttentionBackend.forward with the CPU-emulated kernels in place of CuPy's.

Everything but the CuPy calls runs as on the GPU: argument packing (checked against the kernels'
signatures), cache writes, decode-only batches through the paged kernel, mixed batches split into
kernel decodes and torch prefill over gathered K/V (chunked prefill with a cached prefix too).
"""

from __future__ import annotations

import pytest
import torch

from backend.attention.cupy_backend import CupyAttentionBackend
from backend.attention.paged import plan_prefill, prefill_attention
from kernels.build_options import paged_attention_spec, reshape_and_cache_spec
from tests.kernels import cases, reference
from tests.kernels.batches import DTYPES, expected_output, make_batch
from tests.kernels.conftest import emulated_launch, emulated_module

pytestmark = pytest.mark.usefixtures("emulation_built")

# (dtype, head_size, partition_size): must be among the emulated attention configs of this run.
BACKEND_CONFIGS = (
    [("float16", 128, 64)] if cases.SANITIZER_RUN else [("float16", 128, 64), ("bfloat16", 80, 512)]
)
# (seq_lens, query_lens): decode only; prefill + decode + chunked prefill with a prefix; a
# one-token chunk after a prefix; prompts that end exactly on block and partition boundaries.
BATCHES = [
    ([9, 33, 70], [1, 1, 1]),
    ([7, 33, 40, 5], [7, 1, 9, 1]),
    ([17, 64, 16], [1, 32, 16]),
]


def make_backend(dtype_name: str, head_size: int, partition_size: int) -> CupyAttentionBackend:
    return CupyAttentionBackend(
        "cpu",
        head_size=head_size,
        dtype=DTYPES[dtype_name],
        partition_size=partition_size,
        module_factory=emulated_module,
        launch=emulated_launch,
    )


@pytest.mark.parametrize("config", BACKEND_CONFIGS, ids=lambda c: f"{c[0]}-h{c[1]}-p{c[2]}")
@pytest.mark.parametrize("lens", BATCHES, ids=["decode", "mixed", "chunked"])
def test_forward_matches_reference(config, lens):
    dtype_name, head_size, partition_size = config
    dtype = DTYPES[dtype_name]
    seq_lens, query_lens = lens
    batch = make_batch(
        seq_lens,
        query_lens,
        num_heads=8,
        num_kv_heads=2,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        seed=11,
    )
    scale = head_size**-0.5
    expected, expected_k, expected_v = expected_output(batch, scale)

    backend = make_backend(dtype_name, head_size, partition_size)
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata, scale
    )

    assert out.shape == batch.query.shape and out.dtype == dtype
    assert torch.equal(batch.key_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(batch.value_cache.view(torch.uint8), expected_v.view(torch.uint8))
    # Prefill rows come from torch SDPA in the model dtype: allow a few units in the last place.
    tol = {k: v * 4 for k, v in cases.tolerances(dtype_name).items()}
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), **tol)


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="no kernel involved")
@pytest.mark.parametrize(("context_len", "q_len"), [(1, 1), (20, 20), (40, 9), (33, 1)])
def test_the_shared_prefill_path_over_its_context(context_len, q_len):
    batch = make_batch([context_len], [q_len], num_heads=6, num_kv_heads=2, head_size=64, block_size=8,
                       dtype=torch.float32, seed=5)
    reference.write_cache(
        batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping
    )
    seq = plan_prefill(batch.metadata, 0, 0, 8, torch.float32)
    assert (seq.block_ids is None) == (q_len == context_len)  # a cached prefix is read from the cache
    out = prefill_attention(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, seq, 3, 0.125)
    expected = reference.paged_varlen(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.metadata.block_tables,
        [context_len],
        [q_len],
        0.125,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="plain build only")
def test_forward_rejects_mismatched_inputs():
    backend = make_backend("float16", 128, 64)
    batch = make_batch(
        [5], [1], num_heads=4, num_kv_heads=2, head_size=128, block_size=16, dtype=torch.float16
    )
    with pytest.raises(ValueError, match="query and caches must share a dtype"):
        backend.forward(
            batch.query.float(),
            batch.key,
            batch.value,
            batch.key_cache,
            batch.value_cache,
            batch.metadata,
            0.1,
        )
    batch.metadata.block_tables = batch.metadata.block_tables.long()
    with pytest.raises(ValueError, match="block_tables must be int32"):
        backend.forward(
            batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata, 0.1
        )


def recording_factory():
    """(the specs built so far, a module factory that records each spec and builds it emulated)."""
    built = []

    def factory(spec):
        built.append(spec)
        return emulated_module(spec)

    return built, factory


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="plain build only")
def test_modules_are_built_once_per_dtype_and_head_size():
    built, factory = recording_factory()

    backend = CupyAttentionBackend(
        "cpu",
        head_size=128,
        dtype=torch.float16,
        partition_size=64,
        module_factory=factory,
        launch=emulated_launch,
    )
    assert built == [
        paged_attention_spec("float16", 128, partition_size=64),
        reshape_and_cache_spec("float16"),
    ]
    backend.load(128, torch.float16)
    batch = make_batch(
        [5, 9], [1, 1], num_heads=4, num_kv_heads=2, head_size=128, block_size=16, dtype=torch.float16
    )
    backend.forward(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata, 0.1
    )
    assert len(built) == 2


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="plain build only")
def test_modules_are_built_on_first_use_without_head_size():
    built, factory = recording_factory()

    backend = CupyAttentionBackend("cpu", partition_size=64, module_factory=factory, launch=emulated_launch)
    assert built == []
    batch = make_batch(
        [5], [1], num_heads=4, num_kv_heads=2, head_size=128, block_size=16, dtype=torch.float16
    )
    backend.forward(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata, 0.1
    )
    assert set(built) == {
        paged_attention_spec("float16", 128, partition_size=64),
        reshape_and_cache_spec("float16"),
    }


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="plain build only")
@pytest.mark.parametrize("lens", BATCHES, ids=["decode", "mixed", "chunked"])
def test_forward_matches_torch_backend(lens):
    """Same step through the torch backend (backend/attention/torch_backend.py) and this one.

    Unowned cache slots hold a large finite value rather than NaN: the torch backend masks padded
    positions with -inf logits, and 0 * NaN would be NaN there (fine for real caches, which are
    finite; this test is about the two backends agreeing).
    """
    torch_backend = pytest.importorskip(
        "backend.attention.torch_backend", reason="torch backend not there yet"
    )
    seq_lens, query_lens = lens
    batch = make_batch(
        seq_lens,
        query_lens,
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype=torch.float16,
        seed=2,
        fill=300.0,
    )
    caches = (batch.key_cache.clone(), batch.value_cache.clone())
    expected = torch_backend.TorchAttentionBackend("cpu").forward(
        batch.query, batch.key, batch.value, *caches, batch.metadata, 0.09
    )
    out = make_backend("float16", 128, 64).forward(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata, 0.09
    )
    assert torch.equal(batch.key_cache.view(torch.int16), caches[0].view(torch.int16))
    assert torch.equal(batch.value_cache.view(torch.int16), caches[1].view(torch.int16))
    tol = {k: v * 4 for k, v in cases.tolerances("float16").items()}
    torch.testing.assert_close(out.float(), expected.float(), **tol)
