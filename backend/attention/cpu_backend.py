"""Paged attention on CPU with decodes read in place: the torch backend with its decode replaced.

The torch backend gathers every decoding sequence's K/V blocks into a padded copy before SDPA;
``perf.profile_step`` measured that gather as half of the attention time of a decode step. Here
decodes go to the C++ kernel (backend/attention/cpu_kernel/paged_decode.cpp), which walks each
sequence's block table and reads K/V where they are, one pass per KV head for all of its query
heads (GQA), with an online softmax in float32 (float32 and bfloat16 caches). The cache write and
prefill (compute-bound, where torch's SDPA does well) stay torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.attention.base import AttentionMetadata
from backend.attention.cpu_kernel.build import CpuKernels
from backend.attention.torch_backend import TorchAttentionBackend, plan_cache_write

KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(slots=True)
class _CpuPlan:
    """The per-step plan: torch's cache write (TorchAttentionBackend.write_cache reads the first
    two), and the decodes' block tables and lengths as the kernel takes them."""

    write_slots: torch.Tensor  # [num_valid] int64 slots to write
    write_rows: torch.Tensor | None  # [num_valid] int64 rows of key/value; None: all rows, in order
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [num_decodes] int32, contiguous


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: CpuKernels):
        super().__init__(torch.device("cpu"))
        self.kernel = kernel

    def plan_step(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _CpuPlan:
        n = metadata.num_decodes
        return _CpuPlan(*plan_cache_write(metadata.slot_mapping),
                        metadata.block_tables[:n].to(torch.int32).contiguous(),
                        metadata.seq_lens[:n].to(torch.int32).contiguous())

    def decode(self, query, key_cache, value_cache, metadata, plan: _CpuPlan, scale: float) -> torch.Tensor:
        return paged_decode(self.kernel, query, key_cache, value_cache, plan.block_tables, plan.seq_lens, scale)


def paged_decode(
    kernel: CpuKernels,
    query: torch.Tensor,  # [n, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [n] int32, contiguous
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_size]
    """Decode attention of one query row per sequence over its paged context, in place."""
    n, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    reason = kernel.unsupported(num_heads // num_kv_heads, head_size, block_size)
    if reason is not None or query.dtype not in KERNEL_DTYPES or not key_cache.is_contiguous():
        raise ValueError(f"the CPU paged decode kernel cannot take {reason or query.dtype or 'a strided cache'}; "
                         "use attention_backend 'torch'")
    query = query.contiguous()
    out = torch.empty_like(query)
    if n == 0:
        return out
    with torch.profiler.record_function("cpu_paged_decode"):  # perf.profile_step counts it as attention
        kernel.paged_decode(KERNEL_DTYPES[query.dtype], query.data_ptr(), key_cache.data_ptr(),
                        value_cache.data_ptr(),
                        block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads,
                        head_size, block_size, block_tables.shape[1], scale)
    return out
