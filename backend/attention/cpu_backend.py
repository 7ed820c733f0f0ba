"""Paged attention on CPU read in place: the torch backend with its decode and prefill replaced.

The torch backend gathers every decoding sequence's K/V blocks into a padded copy before SDPA;
``perf.profile_step`` measured that gather as half of the attention time of a decode step. Here
decodes go to the C++ kernel (backend/attention/cpu_kernel/paged_decode.cpp), which walks each
sequence's block table and reads K/V where they are, all KV heads of a block at once and their
query heads together (GQA), and prefill chunks to a flash-attention kernel over the same cache
(paged_prefill.cpp, AVX-512: vdpbf16ps for bfloat16), which replaced SDPA's CPU flash attention
(a float32 MKL GEMM on converted bfloat16 tiles, about 70 GFLOP/s here). Without AVX-512 the
prefill stays SDPA's. The cache write is torch's unless the model's fused rotary kernel did it.
Both kernels take the sliding window (0: none) and read only the blocks it reaches.

On a CPU with AMX, SDPA's bfloat16 flash attention multiplies its tiles with AMX (oneDNN's
brgemm) and overtakes the vdpbf16ps kernel once a chunk is long enough (perf/RESULTS.md): there,
bfloat16 chunks of at least ``AMX_SDPA_MIN_QUERY_LEN`` tokens go to SDPA, one call each, and
the shorter ones to the kernel, which takes each run of consecutive short chunks in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.attention.base import AttentionMetadata
from backend.attention.cpu_kernel.build import CpuKernels
from backend.attention.cpu_kernel.dtypes import KERNEL_DTYPES
from backend.attention.cpu_kernel.profiling import kernel_label
from backend.attention.torch_backend import TorchAttentionBackend, plan_cache_write

AMX_SDPA_MIN_QUERY_LEN = 96  # bfloat16 chunks this long or longer go to SDPA where the CPU has AMX


def amx_sdpa_min_query_len() -> int | None:
    """The chunk length from which bfloat16 prefill goes to SDPA here: None without AMX."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return AMX_SDPA_MIN_QUERY_LEN if supported is not None and supported() else None


@dataclass(slots=True)
class _CpuPlan:
    """The per-step plan: torch's cache write (TorchAttentionBackend.write_cache reads the first
    two), and the decodes' block tables and lengths as the kernel takes them."""

    write_slots: torch.Tensor  # [num_valid] int64 slots to write
    write_rows: torch.Tensor | None  # [num_valid] int64 rows of key/value; None: all rows, in order
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [num_decodes] int32, contiguous
    window: int = 0  # sliding window; 0: none
    sdpa_seqs: tuple[int, ...] = ()  # prefill sequences that go to SDPA rather than to the kernel


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: CpuKernels, sdpa_min_query_len: int | None | str = "auto"):
        """``sdpa_min_query_len``: bfloat16 prefill chunks at least this long go to SDPA (None: none;
        "auto": AMX_SDPA_MIN_QUERY_LEN on a CPU with AMX, else none)."""
        super().__init__(torch.device("cpu"))
        self.kernel = kernel
        self.sdpa_min_query_len = amx_sdpa_min_query_len() if sdpa_min_query_len == "auto" else sdpa_min_query_len

    def plan_step(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int = 0) -> _CpuPlan:
        n = metadata.num_decodes
        return _CpuPlan(*plan_cache_write(metadata.slot_mapping),
                        metadata.block_tables[:n].to(torch.int32).contiguous(),
                        metadata.seq_lens[:n].to(torch.int32).contiguous(), window,
                        tuple(self._sdpa_chunks(metadata, dtype)))

    def decode(self, query, key_cache, value_cache, metadata, plan: _CpuPlan, scale: float) -> torch.Tensor:
        return paged_decode(self.kernel, query, key_cache, value_cache, plan.block_tables, plan.seq_lens, scale,
                            plan.window)

    def takes_prefill(self, query: torch.Tensor) -> bool:
        """Whether the prefill kernel serves this dtype and head size on this build."""
        head_size = query.shape[-1]
        return (self.kernel.prefill_available and query.dtype in KERNEL_DTYPES and head_size % 16 == 0
                and head_size <= self.kernel.max_head_size)

    def plan_prefills(self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int = 0):
        if not (self.kernel.prefill_available and dtype in KERNEL_DTYPES):
            return super().plan_prefills(metadata, block_size, dtype, window)
        # the kernel reads the metadata itself; SDPA's masks are built only for the chunks it takes
        return super().plan_prefills(metadata, block_size, dtype, window, seqs=set(self._sdpa_chunks(metadata, dtype)))

    def _sdpa_chunks(self, metadata: AttentionMetadata, dtype: torch.dtype) -> list[int]:
        """The prefill sequences that go to SDPA rather than to the kernel."""
        least = self.sdpa_min_query_len
        if least is None or dtype != torch.bfloat16:
            return []
        lens = metadata.query_lens_list
        return [i for i in range(metadata.num_decodes, metadata.num_seqs) if lens[i] >= least]

    def prefill(self, query, key, value, key_cache, value_cache, plan, scale: float, output: torch.Tensor) -> None:
        metadata = plan.metadata
        if not self.takes_prefill(query):
            if len(plan.prefills) < metadata.num_seqs - metadata.num_decodes:  # planned for the kernel, but
                # this head size needs SDPA for every chunk after all
                plan.prefills = super().plan_prefills(metadata, plan.block_size, plan.dtype, plan.window)
            super().prefill(query, key, value, key_cache, value_cache, plan, scale, output)
            return
        to_sdpa = plan.backend.sdpa_seqs  # planned once a step, for the step's dtype
        if not to_sdpa:
            paged_prefill(self.kernel, query, key_cache, value_cache, metadata, scale, output, plan.window)
            return
        super().prefill(query, key, value, key_cache, value_cache, plan, scale, output)  # plan.prefills: those
        first = metadata.num_decodes
        for end in [*to_sdpa, metadata.num_seqs]:  # each run of kernel chunks between them, in one call
            if end > first:
                paged_prefill(self.kernel, query, key_cache, value_cache, metadata, scale, output, plan.window,
                              seqs=(first, end))
            first = end + 1


def paged_decode(
    kernel: CpuKernels,
    query: torch.Tensor,  # [n, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [n] int32, contiguous
    scale: float,
    sliding_window: int = 0,  # each row sees its last sliding_window positions; 0: all
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
    with kernel_label("cpu_paged_decode"):  # perf.profile_step counts it as attention
        kernel.paged_decode(KERNEL_DTYPES[query.dtype], query.data_ptr(), key_cache.data_ptr(),
                        value_cache.data_ptr(),
                        block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads,
                        head_size, block_size, block_tables.shape[1], scale, sliding_window or 0)
    return out


def paged_prefill(
    kernel: CpuKernels,
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], this step written
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], contiguous: prefill rows written
    sliding_window: int = 0,  # position i sees keys i - sliding_window < j <= i; 0: all j <= i
    seqs: tuple[int, int] | None = None,  # only prefill sequences first..end-1; None: num_decodes..num_seqs
) -> None:
    """Causal attention of every prefill chunk (sequences num_decodes.. of the step, or ``seqs``) over
    its context."""
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    first, end = seqs if seqs is not None else (metadata.num_decodes, metadata.num_seqs)
    query = query.contiguous()
    tables, seq_lens, starts = (metadata.block_tables.to(torch.int32).contiguous(),
                                metadata.seq_lens.contiguous(), metadata.query_start_loc.contiguous())
    with kernel_label("cpu_paged_prefill"):  # perf.profile_step counts it as attention
        kernel.paged_prefill(KERNEL_DTYPES[query.dtype], query.data_ptr(), key_cache.data_ptr(),
                             value_cache.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(), starts.data_ptr(),
                             output.data_ptr(), first, end, num_heads, num_kv_heads,
                             head_size, block_size, tables.shape[1], scale, sliding_window or 0)
