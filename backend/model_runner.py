"""Turns one scheduler step into a flattened forward pass and returns the logits to sample from.

The runner owns the paged KV cache tensors (one ``(key_cache, value_cache)`` pair per layer) and
builds the step's batch: ``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
``seq_lens``, ``query_start_loc``, with numpy vector ops (no per-token Python loops). Logits are
computed only for requests whose scheduled chunk reaches their last token (a finished prefill or
a decode); a partial prefill chunk samples nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from backend.attention.base import AttentionMetadata
from backend.models.llama import get_head_size, get_num_kv_heads


class ScheduledLike(Protocol):
    """What the runner reads of a scheduled request (backend.scheduler.ScheduledRequest)."""

    request: object  # backend.request.Request: all_token_ids, num_tokens
    num_new_tokens: int
    num_computed_tokens: int  # snapshot before this step
    block_ids: list[int]  # the request's whole block table


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_size].

    Zeros matter: padded block-table entries point at block 0 and masked keys must stay finite.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (for sizing num_kv_blocks)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * block_size * get_num_kv_heads(hf_config) * get_head_size(hf_config) * element_size
    return per_layer * hf_config.num_hidden_layers


_ALLOCATOR_TUNED = False


def tune_cpu_allocator() -> None:
    """Keeps glibc malloc from returning big buffers to the OS after every op (Linux, CPU only).

    Activations of a step are a few hundred KB to a few MB: above glibc's default mmap threshold
    each one is a fresh mmap whose pages fault in on first touch (~7-9k faults per decode step of
    a 30M model, ~30% of its time here). Raising the mmap and trim thresholds lets freed buffers be
    reused. Process-wide and idempotent; vLLM CPU gets the same effect by preloading tcmalloc.
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 64 << 20)
        libc.mallopt(m_trim_threshold, 256 << 20)
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        pass
    _ALLOCATOR_TUNED = True


class ModelRunner:
    """Runs the model over the paged KV cache for one scheduled step at a time."""

    def __init__(
        self,
        model,
        hf_config,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x [num_blocks, block_size, num_kv_heads, head_size]
        block_size: int,
        device,
        attention_backend=None,
    ):
        """``attention_backend``, when given, replaces the model's (every layer uses it)."""
        if attention_backend is not None:
            model.set_attention_backend(attention_backend)
        self.model = model
        self.hf_config = hf_config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.vocab_size = hf_config.vocab_size
        if self.device.type == "cpu":
            tune_cpu_allocator()

    def prepare(self, scheduled: Sequence[ScheduledLike]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Builds (input_ids, positions, metadata, sample_rows, sample_indices) for one step.

        sample_rows: the flattened row of each sampled request's last token; sample_indices: the
        position of that request in ``scheduled``.
        """
        bs = self.block_size
        num_seqs = len(scheduled)
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = num_computed + num_new
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        token_ids: list[int] = []
        blocks_needed = (seq_lens + bs - 1) // bs
        block_tables = np.zeros((num_seqs, int(blocks_needed.max())), dtype=np.int32)  # padded with the null block
        sample_rows: list[int] = []
        sample_indices: list[int] = []
        for i, item in enumerate(scheduled):
            start, end = int(num_computed[i]), int(seq_lens[i])
            all_ids = item.request.all_token_ids
            token_ids.extend(all_ids[start:end])
            needed = int(blocks_needed[i])
            if len(item.block_ids) < needed:
                raise ValueError(
                    f"request {getattr(item.request, 'request_id', i)}: {len(item.block_ids)} blocks "
                    f"cannot hold {end} tokens (block_size {bs})"
                )
            block_tables[i, :needed] = item.block_ids[:needed]
            if end == len(all_ids):
                sample_rows.append(int(query_start_loc[i + 1]) - 1)
                sample_indices.append(i)

        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - num_computed, num_new)
        slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        device = self.device
        query_lens_list = num_new.tolist()
        seq_lens_list = seq_lens.tolist()
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            max_query_len=max(query_lens_list),
            max_seq_len=max(seq_lens_list),
            num_decode_only=all(q == 1 for q in query_lens_list),
            seq_lens_list=seq_lens_list,
            query_lens_list=query_lens_list,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(device)
        return input_ids, torch.from_numpy(positions).to(device), metadata, sample_rows, sample_indices

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledLike]) -> tuple[torch.Tensor, list[int]]:
        """Runs one step. Returns (logits [num_sampling_rows, vocab] float32, indices into ``scheduled``)."""
        if not scheduled:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device), []
        input_ids, positions, metadata, sample_rows, sample_indices = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [num_tokens, hidden_size]
        if not sample_rows:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device), []
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.int64, device=hidden.device))
        return self.model.compute_logits(hidden), sample_indices
