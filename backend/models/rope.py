"""Rotary position embedding (RoPE) with a precomputed cos/sin cache indexed by positions.

Why a cache: positions of a flattened batch are arbitrary (chunked prefill, decode at ``len - 1``),
so one ``index_select`` per step beats recomputing ``cos(pos * inv_freq)``. Values match
transformers exactly: angles are computed in float32 as ``position * inv_freq``, scaled by the
type's attention factor (yarn, longrope) and cast to the model dtype afterwards. default, linear
and llama3 are computed here; yarn, longrope and dynamic come from transformers' own
``ROPE_INIT_FUNCTIONS``. A ``partial_rotary_factor`` (Phi) rotates the first part of each head only.

Two types depend on the length in transformers, which recomputes the frequencies once a forward
pass runs past a threshold; the engine fixes them for ``max_model_len`` instead, so a token's
rotation never depends on what else is in the batch: longrope takes its long factors for every
position when ``max_model_len`` exceeds ``original_max_position_embeddings`` (its short factors
otherwise: exactly transformers within the original context), and dynamic is refused beyond
``max_position_embeddings`` (below it, it is the default rotation).
"""

from __future__ import annotations

import math

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LAYER_TYPE_OF_KEY = {"global": "full_attention", "local": "sliding_attention"}


def get_rope_parameters(hf_config, rope_key: str = "global") -> dict:
    """The RoPE settings of a config (of one layer type, for configs that give each its own), as
    one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``rope_parameters``; older configs use ``rope_theta`` plus an
    optional ``rope_scaling`` dict (whose type key is ``type`` or ``rope_type``).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if _per_layer_type(hf_config):  # Gemma 3
        params = params.get(LAYER_TYPE_OF_KEY[rope_key]) or params.get("full_attention")
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
    params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    return params


def compute_inv_freq(params: dict, head_size: int) -> torch.Tensor:  # -> [rotary_dim // 2] float32
    """Inverse frequencies of default, linear and llama3, bit-identical to transformers'
    ROPE_INIT_FUNCTIONS, over ``head_size * partial_rotary_factor`` dimensions."""
    dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def rotary_frequencies(hf_config, rope_key: str, head_size: int,
                       max_model_len: int | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, the factor cos and sin are scaled by) of a
    layer type; ValueError names what cannot be served."""
    params = get_rope_parameters(hf_config, rope_key)
    rope_type = params["rope_type"]
    if rope_type in ("default", "linear", "llama3"):
        return compute_inv_freq(params, head_size), 1.0

    layer_type = LAYER_TYPE_OF_KEY[rope_key] if _per_layer_type(hf_config) else None
    kwargs = {"layer_type": layer_type} if layer_type else {}
    if rope_type == "dynamic":
        limit = getattr(hf_config, "max_position_embeddings", None)
        if max_model_len and limit and max_model_len > limit:
            raise ValueError(f"rope_type 'dynamic' beyond max_position_embeddings {limit} is not supported; "
                             f"set max_model_len <= {limit}")
    elif rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None)
        if max_model_len and original and max_model_len > original:
            kwargs["seq_len"] = max_model_len  # the long factors, for every position
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def _per_layer_type(hf_config) -> bool:
    """Whether ``rope_parameters`` holds one dict per layer type rather than one set of settings."""
    params = getattr(hf_config, "rope_parameters", None)
    return bool(params) and all(isinstance(value, dict) for value in params.values())


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE over a cos/sin cache that grows on demand.

    Not an nn.Module on purpose: the cache is derived state, never loaded from a checkpoint.
    ``inv_freq`` may cover fewer dimensions than the head (partial rotary): the rest pass unchanged.
    """

    def __init__(self, params: dict | None, head_size: int, dtype: torch.dtype, device: torch.device,
                 initial_len: int = 4096, inv_freq: torch.Tensor | None = None, scaling: float = 1.0):
        self.head_size = head_size
        self.dtype = dtype
        self.device = device
        # [rotary_dim // 2] float32, on the CPU
        self.inv_freq = compute_inv_freq(params, head_size) if inv_freq is None else inv_freq
        self.rotary_dim = 2 * self.inv_freq.shape[0]
        self.scaling = scaling
        self.cos_sin_cache = torch.empty(0)  # [max_len, rotary_dim]: cos half | sin half
        self._build(initial_len)

    def _build(self, max_len: int) -> None:
        positions = torch.arange(max_len, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # [max_len, rotary_dim // 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        if self.scaling != 1.0:
            cache = cache * self.scaling
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
        half = self.rotary_dim // 2
        cos_sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
        rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        if self.rotary_dim == self.head_size:
            return torch.cat(rotated, dim=-1)
        return torch.cat((*rotated, x[..., self.rotary_dim:]), dim=-1)
