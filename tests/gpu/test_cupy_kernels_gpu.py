"""The CuPy-launched kernels on a real GPU against the torch reference (computed on the CPU).

The same batches as the CPU-emulation tests (tests/kernels/cases.py: dtypes, head sizes, GQA
ratios, block sizes, partitions, NaN-poisoned caches), plus what only a GPU makes cheap: many
long sequences, every head size the backend compiles, block offsets past 2^31 elements.
"""

from __future__ import annotations

import math

import pytest
import torch

from backend.attention.cupy_backend import CupyAttentionBackend
from kernels.build_options import HEAD_SIZES
from tests.kernels import cases, reference
from tests.kernels.batches import DTYPES, expected_output, make_batch, to_device

CUDA = torch.device("cuda")


def gpu_tolerances(dtype_name: str) -> dict[str, float]:
    """A little looser than the CPU emulation: __expf and flush-to-zero (CuPy compiles with -ftz)."""
    return {k: v * 4 for k, v in cases.tolerances(dtype_name).items()}


def check_step(
    dtype_name, head_size, partition_size, seq_lens, query_lens, *, num_heads, num_kv_heads, block_size, **kw
):
    dtype = DTYPES[dtype_name]
    batch = make_batch(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        **kw,
    )
    scale = head_size**-0.5
    expected, expected_k, expected_v = expected_output(batch, scale)
    gpu = to_device(batch, CUDA)
    backend = CupyAttentionBackend(CUDA, head_size=head_size, dtype=dtype, partition_size=partition_size)
    out = backend.forward(gpu.query, gpu.key, gpu.value, gpu.key_cache, gpu.value_cache, gpu.metadata, scale)
    torch.cuda.synchronize()
    assert torch.equal(gpu.key_cache.cpu().view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(gpu.value_cache.cpu().view(torch.uint8), expected_v.view(torch.uint8))
    out = out.cpu()
    assert not out.isnan().any(), "the kernel read outside the context (NaN poison)"
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), **gpu_tolerances(dtype_name))


@pytest.mark.parametrize(
    ("config", "case"),
    cases.decode_params(),
    ids=[f"{d}-h{hs}-p{p}-{c}" for (d, hs, p), c in cases.decode_params()],
)
def test_decode_matches_reference(config, case):
    dtype_name, head_size, partition_size = config
    check_step(
        dtype_name,
        head_size,
        partition_size,
        list(case.seq_lens),
        [1] * len(case.seq_lens),
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        block_size=case.block_size,
        max_blocks=case.max_blocks,
        query_scale=case.query_scale,
    )


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_every_compiled_head_size(dtype_name, head_size):
    """Decode and mixed steps for every (dtype, head size) the backend compiles."""
    check_step(
        dtype_name, head_size, 512, [1, 17, 600, 33], [1, 1, 1, 9], num_heads=8, num_kv_heads=2, block_size=16
    )


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_many_long_sequences(dtype_name):
    """64 sequences up to 3000 tokens, GQA 4: partitions, reduce and a big grid."""
    g = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 3000, (64,), generator=g).tolist()
    check_step(
        dtype_name, 128, 512, seq_lens, [1] * 64, num_heads=16, num_kv_heads=4, block_size=16, fill=0.0
    )


def test_block_offsets_beyond_32_bits():
    """A cache of more than 2^31 elements, read at blocks near its end (64-bit offsets)."""
    head_size, num_kv_heads, block_size = 256, 8, 16
    block_stride = block_size * num_kv_heads * head_size
    num_blocks = 2**31 // block_stride + 600
    if torch.cuda.mem_get_info()[0] < 3 * num_blocks * block_stride * 2:
        pytest.skip("needs ~14 GB of free GPU memory")
    key_cache = torch.zeros(
        (num_blocks, block_size, num_kv_heads, head_size), dtype=torch.float16, device=CUDA
    )
    value_cache = torch.zeros_like(key_cache)
    seq_lens = torch.tensor([40, 17], dtype=torch.int32)
    block_tables = torch.tensor(
        [[num_blocks - 1, 1, num_blocks - 300], [num_blocks - 2, num_blocks - 150, 0]], dtype=torch.int32
    )
    g = torch.Generator().manual_seed(7)
    used = sorted({int(b) for b in block_tables.flatten()} - {0})
    for b in used:
        key_cache[b] = torch.randn((block_size, num_kv_heads, head_size), generator=g).half().to(CUDA)
        value_cache[b] = torch.randn((block_size, num_kv_heads, head_size), generator=g).half().to(CUDA)
    query = torch.randn((2, 16, head_size), generator=g).half()
    backend = CupyAttentionBackend(CUDA, head_size=head_size, dtype=torch.float16)
    out = torch.empty_like(query, device=CUDA)
    backend.decode_into(
        out, query.to(CUDA), key_cache, value_cache, block_tables.to(CUDA), seq_lens.to(CUDA), 0.0625, 40
    )
    remap = {b: i + 1 for i, b in enumerate(used)}  # reference on the CPU over just the used blocks
    small_k = torch.zeros((len(used) + 1, block_size, num_kv_heads, head_size), dtype=torch.float16)
    small_v = torch.zeros_like(small_k)
    for b, i in remap.items():
        small_k[i], small_v[i] = key_cache[b].cpu(), value_cache[b].cpu()
    small_tables = block_tables.clone().apply_(lambda b: remap.get(b, 0))
    expected = reference.paged_decode(query, small_k, small_v, small_tables, seq_lens, 0.0625)
    torch.testing.assert_close(out.cpu().float(), expected.half().float(), **gpu_tolerances("float16"))


def _two_decodes():
    return make_batch([40, 70], [1, 1], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                      dtype=torch.float16, fill=0.0)


def test_runs_on_torchs_current_stream():
    """Work queued on a side stream is ordered with the kernels (ExternalStream), no extra sync."""
    batch = to_device(_two_decodes(), CUDA)
    backend = CupyAttentionBackend(CUDA, head_size=128, dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        query = batch.query * 2  # produced on the side stream ...
        out = backend.forward(
            query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata, 0.1
        )
        check = out.float().sum()  # ... and consumed there
    torch.cuda.synchronize()
    cpu = _two_decodes()
    cpu.query = cpu.query * 2
    expected, _, _ = expected_output(cpu, 0.1)
    assert math.isfinite(float(check))
    torch.testing.assert_close(out.cpu().float(), expected.half().float(), **gpu_tolerances("float16"))
