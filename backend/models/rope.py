"""Rotary position embedding (RoPE) with a precomputed cos/sin cache indexed by positions.

Why a cache: positions of a flattened batch are arbitrary (chunked prefill, decode at ``len - 1``),
so one ``index_select`` per step beats recomputing ``cos(pos * inv_freq)``. Values match
transformers exactly: angles are computed in float32 as ``position * inv_freq`` and cast to the
model dtype afterwards. Supported ``rope_type``: default, linear, llama3 (Llama 3.1+).
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(hf_config) -> dict:
    """The RoPE settings of a config, as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``rope_parameters``; older configs use ``rope_theta`` plus an
    optional ``rope_scaling`` dict (whose type key is ``type`` or ``rope_type``).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type '{params['rope_type']}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return params


def compute_inv_freq(params: dict, head_size: int) -> torch.Tensor:  # -> [head_size // 2] float32
    """Inverse frequencies, bit-identical to transformers' ROPE_INIT_FUNCTIONS."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    rope_type = params["rope_type"]
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE over a cos/sin cache that grows on demand.

    Not an nn.Module on purpose: the cache is derived state, never loaded from a checkpoint.
    """

    def __init__(self, params: dict, head_size: int, dtype: torch.dtype, device: torch.device,
                 initial_len: int = 4096):
        self.head_size = head_size
        self.dtype = dtype
        self.device = device
        self.inv_freq = compute_inv_freq(params, head_size)  # [head_size // 2] float32, on the CPU
        self.cos_sin_cache = torch.empty(0)  # [max_len, head_size]: cos half | sin half
        self._build(initial_len)

    def _build(self, max_len: int) -> None:
        positions = torch.arange(max_len, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # [max_len, head_size // 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.cos_sin_cache = cache.to(device=self.device, dtype=self.dtype)

    def ensure_len(self, max_len: int) -> None:
        """Grows the cache to cover positions < max_len (host-side check, no device sync)."""
        if max_len > self.cos_sin_cache.shape[0]:
            self._build(max(max_len, 2 * self.cos_sin_cache.shape[0]))

    def __call__(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        x: torch.Tensor,  # [num_tokens, num_heads, head_size] (q and k heads together)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        half = self.head_size // 2
        cos_sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)  # [num_tokens, 1, head_size]
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
