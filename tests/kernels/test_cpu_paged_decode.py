"""The CPU paged decode kernel (backend/attention/cpu_kernel) against the reference attention.

Random paged batches from tests/kernels/batches.py: shuffled block tables, partial last blocks,
caches filled with NaN wherever no sequence owns a slot (so a read out of bounds shows up as NaN).
Tolerances against the float64-free float32 reference: float32 within 2e-5 (accumulation order
only); bfloat16 within 2e-2 absolute, which is the rounding of the bfloat16 output itself (8
mantissa bits on values up to about 2), the kernel accumulating in float32 like the reference.
"""

from __future__ import annotations

import pytest
import torch

from backend.attention.base import AttentionMetadata
from backend.attention.cpu_backend import CpuAttentionBackend, paged_decode
from backend.attention.cpu_kernel import build
from backend.attention.selector import get_attention_backend
from backend.attention.torch_backend import TorchAttentionBackend
from tests.kernels.batches import expected_output, make_batch
from tests.kernels.conftest import both_builds

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (num_heads, num_kv_heads): GQA ratios 1, 3, 4 and 8
HEADS = [(4, 4), (9, 3), (8, 2), (16, 2)]


@pytest.fixture(params=["native", "avx2"])
def kernel(request, cpu_kernels):
    """This CPU's build and the build without AVX-512 (tests/kernels/conftest.py)."""
    return both_builds(request, cpu_kernels)


def decode_and_compare(kernel, seq_lens, heads, head_size, dtype, block_size=16, seed=0):
    num_heads, num_kv_heads = heads
    batch = make_batch(seq_lens, [1] * len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, dtype=dtype, seed=seed)
    scale = head_size ** -0.5
    expected, key_cache, value_cache = expected_output(batch, scale)
    md = batch.metadata
    out = paged_decode(kernel, batch.query, key_cache, value_cache, md.block_tables, md.seq_lens, scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert not torch.isnan(out).any()
    error = (out.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_the_kernel_equals_the_reference(kernel, heads, head_size, dtype):
    # one token, a partial block, exactly one block, one past it, and longer contexts
    decode_and_compare(kernel, [1, 7, 16, 17, 100, 333], heads, head_size, dtype, seed=head_size + heads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_up_to_4k(kernel, dtype):
    decode_and_compare(kernel, [4096, 2049, 1], (8, 2), 128, dtype, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_sizes_the_avx2_path_does_not_take_use_the_plain_loops(kernel, dtype):
    decode_and_compare(kernel, [1, 17, 100], (9, 3), 36, dtype, seed=36)  # 36 is not a multiple of 8


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(kernel, block_size):
    decode_and_compare(kernel, [1, 31, 64, 95], (9, 3), 64, torch.float32, block_size=block_size, seed=block_size)


@pytest.mark.parametrize("block_size", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_blocks_filling_whole_partitions(kernel, block_size, dtype):
    """Contexts over the kernel's 512-token partitions with blocks narrower than a vector: the last
    block of a full partition writes a whole vector of scores, which must not land in the next
    head's row (it did, before the score rows were padded)."""
    decode_and_compare(kernel, [1100, 600, 513, 512], (9, 3), 64, dtype, block_size=block_size, seed=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_backend_equals_the_torch_backend_on_a_mixed_step(kernel, dtype):
    """A whole forward (cache write, decodes through the kernel, a prefill chunk over a cached
    prefix through torch) against the torch backend on the same inputs. Zero-filled caches: the
    torch backend's gathered padding would turn NaN into NaN outputs (0 x NaN under its mask)."""
    batch = make_batch([40, 1, 250, 90], [1, 1, 1, 30], num_heads=9, num_kv_heads=3, head_size=64,
                       block_size=16, dtype=dtype, seed=11, fill=0.0)
    outputs = []
    for backend in (TorchAttentionBackend("cpu"), CpuAttentionBackend(kernel)):
        key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
        outputs.append(backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache,
                                       batch.metadata, 0.125))
    error = (outputs[0].float() - outputs[1].float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"


def test_a_step_without_decodes_never_calls_the_kernel(kernel):
    backend = CpuAttentionBackend(kernel)
    key_cache = torch.zeros(4, 4, 2, 8)
    metadata = AttentionMetadata.build(torch.tensor([4, 5, 6], dtype=torch.int64),
                                       torch.tensor([[1]], dtype=torch.int32), [3], [3])
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    out = backend.forward(q, k, k.clone(), key_cache, key_cache.clone(), metadata, 0.3)
    assert out.shape == (3, 4, 8) and not torch.isnan(out).any()


def test_shapes_beyond_the_kernel_are_refused_by_name(kernel):
    assert kernel.unsupported(kernel.max_group + 1, 64, 16).startswith(f"{kernel.max_group + 1} query heads")
    assert "head size 512" in kernel.unsupported(1, 512, 16)
    assert kernel.unsupported(4, 128, 16) is None
    with pytest.raises(ValueError, match="cpu"):
        get_attention_backend("cpu", "cpu", head_size=512, dtype=torch.float32, group=1, block_size=16)
    assert get_attention_backend("auto", "cpu", head_size=512, dtype=torch.float32).name == "torch"
    assert get_attention_backend("auto", "cpu", head_size=64, dtype=torch.float16).name == "torch"
    assert get_attention_backend("auto", "cpu", head_size=64, dtype=torch.float32, group=3, block_size=16).name == "cpu"


def test_without_a_compiler_auto_falls_back_to_torch_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setenv("LLM_CPU_KERNEL_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with caplog.at_level("WARNING"):
        backend = get_attention_backend("auto", "cpu", head_size=64, dtype=torch.float32, group=3, block_size=16)
    assert backend.name == "torch"
    assert "CPU paged decode kernel is not used" in caplog.text and "no-such-g++" in caplog.text
    with pytest.raises(ValueError, match="'cpu' cannot run here"):
        get_attention_backend("cpu", "cpu")
    monkeypatch.setattr(build, "_loaded", None)  # the next test builds (from its cache) again


def test_a_source_that_does_not_compile_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    bad = tmp_path / "paged_decode.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCES", [bad])
    monkeypatch.setenv("LLM_CPU_KERNEL_DIR", str(tmp_path / "cache"))
    with pytest.raises(build.KernelUnavailable, match="compiling the CPU kernels failed"):
        build.build_library()
    assert not list((tmp_path / "cache").rglob("*.so*"))  # no partial library left behind


def test_the_decode_attention_benchmark_runs_at_toy_size(capsys):
    """perf.decode_attention: every row printed (its own assert checks the kernel against torch)."""
    from perf import decode_attention

    assert decode_attention.main(["--batch", "3", "--contexts", "20,40", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| demo") or
            line.startswith("| smollm2")]
    assert len(rows) == 2 * 2 * 3  # models x dtypes x (2 contexts + mixed)
