"""The shapes and kernel configurations the kernel tests run, in one place.

Inside a sanitizer run (KERNEL_EMULATION_VARIANT=tsan or asan, set by test_kernel_sanitizers.py)
the same tests run on a smaller set of configurations: ThreadSanitizer and AddressSanitizer are
after races and out-of-bounds accesses, which do not depend on the dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VARIANT = os.environ.get("KERNEL_EMULATION_VARIANT", "plain")
SANITIZER_RUN = VARIANT != "plain"

# (dtype, head_size, partition_size): every dtype and every tested head size at the production
# partition size, and a 64-token partition so short contexts exercise the partition reduce.
ATTENTION_CONFIGS: list[tuple[str, int, int]] = [
    ("float16", 128, 512),
    ("bfloat16", 128, 512),
    ("float32", 128, 512),
    ("float16", 64, 512),
    ("bfloat16", 80, 512),
    ("float32", 96, 512),
    ("bfloat16", 112, 512),
    ("float16", 256, 512),
    ("float32", 32, 512),
    ("float16", 48, 512),
    ("float16", 128, 64),
    ("bfloat16", 80, 64),
    ("float32", 64, 64),
]
SANITIZER_ATTENTION_CONFIGS = [("float16", 128, 64), ("bfloat16", 80, 512)]
# The configurations the GQA / block-size / long-context cases run on.
WIDE_CASE_CONFIGS = [("float16", 128, 64), ("bfloat16", 128, 512)]


@dataclass(frozen=True)
class DecodeCase:
    """One decode batch: a sequence per entry of seq_lens, one new token each."""

    name: str
    num_heads: int
    num_kv_heads: int
    block_size: int
    seq_lens: tuple[int, ...]
    max_blocks: int | None = None  # block-table width; None: just enough for the longest (a full row)
    query_scale: float = 1.0  # > 1 makes the softmax peaked (large logits)

    def __str__(self) -> str:
        return self.name


# Every configuration: lengths 1 .. several blocks, exact multiples of the block size, a last
# block-table row that is full (the last sequence is the longest), no GQA and GQA 4.
BASIC_DECODE_CASES = [
    DecodeCase("lens1-16-33_full_row", 4, 4, 16, (1, 16, 33)),
    DecodeCase("gqa4_multiple_of_block", 8, 2, 16, (15, 48)),
]
# Fewer configurations: every GQA ratio the models use, other block sizes, padded block tables,
# contexts spanning partitions (exact multiples of the partition too), peaked softmax.
WIDE_DECODE_CASES = [
    DecodeCase("gqa2_block8", 4, 2, 8, (7, 8, 9, 65), max_blocks=12),
    DecodeCase("gqa3_block32", 6, 2, 32, (31, 64, 97)),
    DecodeCase("gqa7", 7, 1, 16, (5, 140)),
    DecodeCase("gqa8_partition_multiples", 8, 1, 16, (64, 128, 192)),
    DecodeCase("peaked_softmax", 4, 2, 16, (3, 77), query_scale=40.0),
    DecodeCase("long_context", 2, 1, 16, (600, 1025)),
]
SANITIZER_DECODE_CASES = [
    DecodeCase("lens1-16-33_full_row", 4, 4, 16, (1, 16, 33)),
    # The last sequence ends exactly on a block boundary with a full block-table row: the entry
    # after its context is past the end of the block-table tensor (AddressSanitizer sees a read).
    DecodeCase("gqa4_multiple_of_block", 8, 2, 16, (15, 48)),
    DecodeCase("gqa4_spans_partitions", 8, 2, 16, (15, 130)),
]


def attention_configs() -> list[tuple[str, int, int]]:
    return SANITIZER_ATTENTION_CONFIGS if SANITIZER_RUN else ATTENTION_CONFIGS


def decode_params() -> list[tuple[tuple[str, int, int], DecodeCase]]:
    """(config, case) pairs of the decode-kernel test."""
    if SANITIZER_RUN:
        return [(c, case) for c in SANITIZER_ATTENTION_CONFIGS for case in SANITIZER_DECODE_CASES]
    params = [(c, case) for c in ATTENTION_CONFIGS for case in BASIC_DECODE_CASES]
    params += [(c, case) for c in WIDE_CASE_CONFIGS for case in WIDE_DECODE_CASES]
    return params


# reshape_and_cache: (dtype, num_kv_heads, head_size, block_size)
CACHE_WRITE_CONFIGS = [
    ("float16", 2, 128, 16),
    ("bfloat16", 1, 80, 8),
    ("float32", 4, 64, 32),
    ("float16", 3, 96, 16),
]
SANITIZER_CACHE_WRITE_CONFIGS = [("float16", 2, 128, 16), ("bfloat16", 1, 80, 8)]


def cache_write_configs() -> list[tuple[str, int, int, int]]:
    return SANITIZER_CACHE_WRITE_CONFIGS if SANITIZER_RUN else CACHE_WRITE_CONFIGS


# lora_shrink / lora_expand: the dtypes (races and bounds do not depend on them)
LORA_DTYPES = ["float32", "bfloat16", "float16"]
SANITIZER_LORA_DTYPES = ["bfloat16"]


def lora_dtypes() -> list[str]:
    return SANITIZER_LORA_DTYPES if SANITIZER_RUN else LORA_DTYPES


def tolerances(dtype: str) -> dict[str, float]:
    """About one unit in the last place of the output dtype (outputs are O(1))."""
    return {
        "float32": {"atol": 2e-5, "rtol": 2e-5},
        "float16": {"atol": 1e-3, "rtol": 1e-3},
        "bfloat16": {"atol": 8e-3, "rtol": 8e-3},
    }[dtype]
