"""Copies of whole blocks between the paged KV cache and host tensors, for the offload tier.

One gather (or scatter) per layer and cache for all the blocks of a call, so spilling the blocks
a step evicts costs a few dozen tensor ops, not a few per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagedBlockIO:
    """Reads and writes blocks of ``kv_caches`` (one (key, value) pair per layer, each
    [num_blocks, block_size, num_kv_heads, head_size])."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        key = kv_caches[0][0]
        self.device = key.device
        self.block_shape = (len(kv_caches), 2, *key.shape[1:])  # [num_layers, 2, block_size, heads, head_size]
        self.bytes_per_block = key[0].numel() * key.element_size() * 2 * len(kv_caches)

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_size] on the CPU (a copy)."""
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        layers = [torch.stack((key.index_select(0, index), value.index_select(0, index)), dim=1)
                  for key, value in self.kv_caches]  # each [n, 2, block_size, heads, head_size]
        return torch.stack(layers, dim=1).cpu()

    def write(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """kv: [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_size] into those blocks."""
        if tuple(kv.shape[1:]) != self.block_shape:
            raise ValueError(f"block shape {tuple(kv.shape[1:])} does not fit this cache {self.block_shape}")
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        kv = kv.to(self.device, non_blocking=True)
        for layer, (key, value) in enumerate(self.kv_caches):
            key.index_copy_(0, index, kv[:, layer, 0].to(key.dtype))
            value.index_copy_(0, index, kv[:, layer, 1].to(value.dtype))

    def copy(self, source_ids: Sequence[int], destination_ids: Sequence[int]) -> None:
        """Copies whole blocks within the cache (copy-on-write of forked sequences)."""
        source = torch.tensor(list(source_ids), dtype=torch.int64, device=self.device)
        destination = torch.tensor(list(destination_ids), dtype=torch.int64, device=self.device)
        for key, value in self.kv_caches:
            key.index_copy_(0, destination, key.index_select(0, source))
            value.index_copy_(0, destination, value.index_select(0, source))
