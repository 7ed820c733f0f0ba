"""reshape_and_cache on the CPU emulation against the torch reference (an exact copy).

K/V come as row-strided views of a fused QKV projection; slots are scattered over shuffled blocks,
some tokens have slot -1 (skipped); every slot not written must keep its old bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.build_options import RESHAPE_MAX_THREADS, reshape_and_cache_spec
from kernels.launch_args import cache_write_args
from tests.kernels import cases, reference
from tests.kernels.batches import DTYPES
from tests.kernels.conftest import emulated_module

pytestmark = pytest.mark.usefixtures("emulation_built")


def run_cache_write(module, key, value, key_cache, value_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    threads = min(RESHAPE_MAX_THREADS, 32 * math.ceil(num_kv_heads * head_size / 32))
    module.get_function("reshape_and_cache")(
        (num_tokens,), (threads,), cache_write_args(key, value, key_cache, value_cache, slot_mapping)
    )


@pytest.mark.parametrize(
    ("dtype_name", "num_kv_heads", "head_size", "block_size"), cases.cache_write_configs()
)
def test_cache_write_matches_reference(dtype_name, num_kv_heads, head_size, block_size):
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(num_kv_heads * 1000 + head_size)
    num_blocks, num_tokens, num_heads = 9, 37, 2 * num_kv_heads
    kv_size = num_kv_heads * head_size
    qkv = torch.randn((num_tokens, num_heads * head_size + 2 * kv_size), generator=g).to(dtype)
    key = qkv[:, num_heads * head_size : num_heads * head_size + kv_size].view(
        num_tokens, num_kv_heads, head_size
    )
    value = qkv[:, num_heads * head_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    # Distinct slots in blocks 1.. (never the null block), in shuffled order; every 5th token skipped.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=g)[:num_tokens] + block_size
    slots[::5] = -1
    key_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), generator=g).to(dtype)
    value_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), generator=g).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.write_cache(key, value, expected_k, expected_v, slots)

    run_cache_write(
        emulated_module(reshape_and_cache_spec(dtype_name)), key, value, key_cache, value_cache, slots
    )
    assert torch.equal(key_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.skipif(cases.SANITIZER_RUN, reason="plain build only")
def test_cache_write_into_interleaved_kv_allocation_and_last_slot():
    """Caches that are views of one [num_blocks, 2, ...] allocation; the very last slot is written."""
    num_blocks, block_size, num_kv_heads, head_size = 5, 16, 2, 64
    kv = torch.zeros((num_blocks, 2, block_size, num_kv_heads, head_size), dtype=torch.float16)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    key = torch.randn((3, num_kv_heads, head_size)).half()
    value = torch.randn((3, num_kv_heads, head_size)).half()
    slots = torch.tensor([num_blocks * block_size - 1, -1, block_size], dtype=torch.int64)
    expected = kv.clone()
    reference.write_cache(key, value, expected[:, 0], expected[:, 1], slots)
    run_cache_write(
        emulated_module(reshape_and_cache_spec("float16")), key, value, key_cache, value_cache, slots
    )
    assert torch.equal(kv, expected)
