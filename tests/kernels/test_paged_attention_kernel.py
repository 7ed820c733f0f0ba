"""paged_attention_decode (+ reduce) on the CPU emulation against the torch reference.

Every configuration of tests/kernels/cases.py: fp32/fp16/bf16, head sizes 64-256, one or several
partitions; contexts of 1 to several blocks, exact multiples of the block size and of the
partition, full last block-table rows, GQA 1/2/3/4/7/8, shuffled block tables, NaN-poisoned cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.build_options import NUM_THREADS, paged_attention_spec
from kernels.launch_args import decode_args, reduce_args
from tests.kernels import cases, reference
from tests.kernels.batches import DTYPES, make_batch
from tests.kernels.conftest import emulated_module

pytestmark = pytest.mark.usefixtures("emulation_built")


def run_decode(module, query, key_cache, value_cache, block_tables, seq_lens, scale, partition_size):
    """Launches the decode kernel (and the reduce kernel when there are several partitions)."""
    num_seqs, num_heads, head_size = query.shape
    num_partitions = math.ceil(int(seq_lens.max()) / partition_size)
    out = torch.empty_like(query)  # [num_seqs, num_heads, head_size]
    tmp_out = torch.full((num_seqs, num_heads, num_partitions, head_size), float("nan"))
    max_logits = torch.full((num_seqs, num_heads, num_partitions), float("nan"))
    exp_sums = torch.full((num_seqs, num_heads, num_partitions), float("nan"))
    module.get_function("paged_attention_decode")(
        (num_heads, num_seqs, num_partitions),
        (NUM_THREADS,),
        decode_args(out, tmp_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables, seq_lens, scale),
    )
    if num_partitions > 1:
        module.get_function("paged_attention_reduce")(
            (num_heads, num_seqs), (NUM_THREADS,), reduce_args(out, tmp_out, max_logits, exp_sums, seq_lens, num_partitions)
        )
    return out


@pytest.mark.parametrize(
    ("config", "case"),
    cases.decode_params(),
    ids=[f"{d}-h{hs}-p{p}-{c}" for (d, hs, p), c in cases.decode_params()],
)
def test_decode_matches_reference(config, case: cases.DecodeCase):
    dtype_name, head_size, partition_size = config
    dtype = DTYPES[dtype_name]
    batch = make_batch(
        list(case.seq_lens),
        [1] * len(case.seq_lens),
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=head_size,
        block_size=case.block_size,
        dtype=dtype,
        max_blocks=case.max_blocks,
        query_scale=case.query_scale,
        seed=hash((config, case.name)) % 2**31,
    )
    # The decode kernel reads the whole context from the cache: write the new tokens first.
    reference.write_cache(
        batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping
    )
    scale = head_size**-0.5
    module = emulated_module(paged_attention_spec(dtype_name, head_size, partition_size=partition_size))
    caches_and_tables = (batch.key_cache, batch.value_cache, batch.metadata.block_tables, batch.metadata.seq_lens)
    out = run_decode(module, batch.query, *caches_and_tables, scale, partition_size)
    expected = reference.paged_decode(batch.query, *caches_and_tables, scale)
    assert not out.isnan().any(), "the kernel read a slot outside the context (NaN poison)"
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), **cases.tolerances(dtype_name))


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="allocates 4.6 GB of (untouched) virtual memory")
def test_decode_block_offsets_beyond_32_bits():
    """Block number x block stride past 2^31 elements: the kernel must use 64-bit offsets."""
    head_size, num_kv_heads, block_size = 256, 8, 16
    block_stride = block_size * num_kv_heads * head_size  # 32768 elements
    num_blocks = (2**31 // block_stride) + 600  # the last blocks start past 2^31 elements
    # torch.empty does not touch the memory: only the pages written below are ever committed.
    key_cache = torch.empty((num_blocks, block_size, num_kv_heads, head_size), dtype=torch.float16)
    value_cache = torch.empty_like(key_cache)
    g = torch.Generator().manual_seed(7)
    seq_lens = torch.tensor([40, 17], dtype=torch.int32)
    block_tables = torch.tensor(
        [[num_blocks - 1, 1, num_blocks - 300], [num_blocks - 2, num_blocks - 150, 0]], dtype=torch.int32
    )
    for i, n in enumerate(seq_lens.tolist()):
        for t in range(n):
            b, o = int(block_tables[i, t // block_size]), t % block_size
            key_cache[b, o] = torch.randn((num_kv_heads, head_size), generator=g).half()
            value_cache[b, o] = torch.randn((num_kv_heads, head_size), generator=g).half()
    query = torch.randn((2, 16, head_size), generator=g).half()
    module = emulated_module(paged_attention_spec("float16", head_size, partition_size=512))
    out = run_decode(module, query, key_cache, value_cache, block_tables, seq_lens, 0.0625, 512)
    expected = reference.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, 0.0625)
    torch.testing.assert_close(out.float(), expected.half().float(), **cases.tolerances("float16"))


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="plain build only")
def test_decode_strided_query_and_shared_kv_allocation():
    """Query rows from a fused QKV output and K/V caches interleaved in one allocation."""
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    batch = make_batch(
        [9, 40],
        [1, 1],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=torch.float16,
        seed=3,
    )
    reference.write_cache(
        batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping
    )
    kv = torch.stack(
        [batch.key_cache, batch.value_cache], dim=1
    )  # [num_blocks, 2, block_size, kv_heads, head]
    key_cache, value_cache = kv[:, 0], kv[:, 1]  # block stride 2 * block_size * kv_heads * head
    qkv = torch.randn((2, (num_heads + 2 * num_kv_heads) * head_size)).half()
    qkv[:, : num_heads * head_size] = batch.query.flatten(1)
    query = qkv[:, : num_heads * head_size].view(2, num_heads, head_size)  # rows qkv.stride(0) apart
    module = emulated_module(paged_attention_spec("float16", head_size, partition_size=512))
    out = run_decode(
        module,
        query,
        key_cache,
        value_cache,
        batch.metadata.block_tables,
        batch.metadata.seq_lens,
        0.125,
        512,
    )
    expected = reference.paged_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.metadata.block_tables,
        batch.metadata.seq_lens,
        0.125,
    )
    torch.testing.assert_close(out.float(), expected.half().float(), **cases.tolerances("float16"))
