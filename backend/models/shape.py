"""The shape facts of a Llama-family checkpoint, derived once from its config.json.

Every part that needs a head size, a KV-head count or a layer count (the loader, the layers, the
KV cache sizing and allocation) reads them from here, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ceil_div(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative integers (blocks for tokens, and the like)."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int  # ``head_dim`` when the config sets it, else hidden_size / num_heads
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def of(cls, hf_config) -> ModelShape:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None)
        return cls(
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_size=int(head_dim) if head_dim else hf_config.hidden_size // num_heads,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes across all layers, keys and values."""
        element_size = torch.tensor([], dtype=dtype).element_size()
        return self.num_layers * 2 * block_size * self.kv_size * element_size
