"""The argument tuples of the kernels, in the order their ``extern "C"`` signatures declare.

One place packs them: the cupy backend launches with these and the kernel tests (CPU emulation)
too, so a signature change is made here once. Strides are in elements; block offsets that can
pass 2^31 elements (block number x block stride) go as int64 (kernels/common.cuh says why).
Works on anything with ``.shape``/``.stride()`` (torch tensors); imports neither torch nor CuPy.
"""

from __future__ import annotations

import numpy as np


def decode_args(out, tmp_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables, seq_lens,
                scale: float, sliding_window: int = 0) -> tuple:
    """paged_attention_decode: out [num_seqs, num_heads, head_size]; tmp_out [num_seqs, num_heads,
    num_partitions, head_size] and max_logits, exp_sums [num_seqs, num_heads, num_partitions] float32
    (placeholders with one partition); query [num_seqs, num_heads, head_size]; caches [num_blocks,
    block_size, num_kv_heads, head_size]; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32;
    sliding_window: each sequence attends its last sliding_window positions (0: all), so the
    partitions need cover only min(max seq_len, sliding_window) tokens."""
    return (
        out, tmp_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables, seq_lens,
        np.float32(scale),
        np.int32(key_cache.shape[2]),  # num_kv_heads
        np.int32(key_cache.shape[1]),  # block_size
        np.int32(block_tables.stride(0)),
        np.int64(query.stride(0)),
        np.int32(query.stride(1)),
        np.int64(key_cache.stride(0)),
        np.int32(key_cache.stride(1)),
        np.int32(key_cache.stride(2)),
        np.int32(sliding_window),
    )


def reduce_args(out, tmp_out, max_logits, exp_sums, seq_lens, num_partitions: int, sliding_window: int = 0) -> tuple:
    """paged_attention_reduce: combines the partitions of decode_args' buffers into ``out`` (the
    same sliding_window)."""
    return (out, tmp_out, max_logits, exp_sums, seq_lens, np.int32(num_partitions), np.int32(sliding_window))


def cache_write_args(key, value, key_cache, value_cache, slot_mapping) -> tuple:
    """reshape_and_cache: key, value [num_tokens, num_kv_heads, head_size] (row-strided views are
    fine); caches [num_blocks, block_size, num_kv_heads, head_size]; slot_mapping [num_tokens] int64."""
    _num_tokens, num_kv_heads, head_size = key.shape
    return (
        key, value, key_cache, value_cache, slot_mapping,
        np.int64(key.stride(0)),
        np.int64(value.stride(0)),
        np.int32(num_kv_heads),
        np.int32(head_size),
        np.int32(key_cache.shape[1]),
        np.int64(key_cache.stride(0)),
        np.int32(key_cache.stride(1)),
        np.int32(key_cache.stride(2)),
    )


def lora_shrink_args(x, a, row_slot, shrunk) -> tuple:
    """lora_shrink: x [rows, in] (a row-strided view is fine); a [slots, parts x rank, in];
    row_slot [rows] int32 (-1: no adapter); shrunk [rows, parts x rank] float32."""
    return (x, a, row_slot, shrunk, np.int64(x.stride(0)), np.int32(x.shape[1]), np.int32(a.shape[1]))


def lora_expand_args(shrunk, bt, row_slot, out, part_columns: tuple[int, ...]) -> tuple:
    """lora_expand: shrunk [rows, parts x rank] float32; bt [slots, rank, out]; row_slot [rows]
    int32; out [rows, out] (row-strided is fine), updated in place; part_columns: each part's
    output columns as offsets ((0, q, q + kv, out) for a fused q/k/v)."""
    out_features = out.shape[1]
    starts = [*part_columns[1:-1], out_features, out_features][:2]
    return (shrunk, bt, row_slot, out, np.int64(out.stride(0)), np.int32(out_features), np.int32(bt.shape[1]),
            np.int32(shrunk.shape[1]), np.int32(starts[0]), np.int32(starts[1]))
