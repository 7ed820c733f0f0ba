"""What sets a supported architecture apart from plain Llama, read once from its config.json.

One decoder (backend/models/llama.py) serves every family; the differences are data, not
subclasses: q/k norms (Qwen3, Gemma 3), Gemma's (1 + weight) RMSNorm, scaled embeddings and
sandwich norms, the MLP's activation, sliding-window layers with their own rotary base, a
partial rotary dimension (Phi), mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE) and
the checkpoint's tensor names. Anything a family may set that we do not run is a ModelLoadError
naming the field, raised at load, never mid-request.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
)
MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA = ("Gemma3ForCausalLM",)
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")


class ModelLoadError(ValueError):
    """The checkpoint cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse MLP: ``top_k`` of ``num_experts`` experts per token, each a gated MLP of
    ``intermediate_size``; the top-k softmax weights renormalised when ``normalize``; an optional
    shared expert (Qwen2-MoE) scaled by a sigmoid gate; Qwen's routers cast the weights to the model
    dtype before the experts use them, Mixtral's keep float32."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    weights_in_model_dtype: bool
    shared_intermediate_size: int = 0


@dataclass(frozen=True, slots=True)
class LayerSpec:
    sliding_window: int | None  # keys within the last ``sliding_window`` positions only; None: global
    rope_key: str  # which rotary table the layer uses ("global" or "local")
    moe: MoeSpec | None  # None: a dense MLP


@dataclass(frozen=True, slots=True)
class ModelFamily:
    architecture: str
    qk_norm: bool  # per-head RMSNorm on q and k before rotary
    gemma_norm: bool  # RMSNorm scales by (1 + weight), computed in float32; sandwich norms around attention and MLP
    activation: str  # the gated MLP's activation (ACTIVATIONS)
    embed_scale: float | None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attention_scale: float | None  # None: head_size ** -0.5
    final_logit_softcapping: float | None
    layers: tuple[LayerSpec, ...]

    @property
    def plain(self) -> bool:
        """Whether this is the plain Llama decoder the fused CPU stack runs (backend/models/cpu_stack.py)."""
        return (not self.qk_norm and not self.gemma_norm and self.activation == "silu" and self.embed_scale is None
                and self.attention_scale is None and self.final_logit_softcapping is None
                and all(spec.sliding_window is None and spec.moe is None and spec.rope_key == "global"
                        for spec in self.layers))

    @property
    def shared_window(self) -> int:
        """The sliding window of every layer (0 when a layer is global or the windows differ):
        the KV of positions before ``seq_len - window`` is then read by no layer at all."""
        windows = {spec.sliding_window for spec in self.layers}
        return (windows.pop() or 0) if len(windows) == 1 else 0

    @property
    def is_moe(self) -> bool:
        return any(spec.moe is not None for spec in self.layers)

    @classmethod
    def of(cls, hf_config) -> ModelFamily:
        architecture = architecture_of(hf_config)
        gemma = architecture in GEMMA
        activation = getattr(hf_config, "hidden_activation" if gemma else "hidden_act", None) or "silu"
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act '{activation}' is not supported (supported: {', '.join(ACTIVATIONS)})")
        if getattr(hf_config, "attn_logit_softcapping", None):
            raise ModelLoadError("attn_logit_softcapping is not supported (Gemma 2 style attention soft-capping)")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ModelLoadError("use_bidirectional_attention is not supported (a causal LM only)")
        return cls(
            architecture=architecture,
            qk_norm=architecture in QK_NORM,
            gemma_norm=gemma,
            activation=activation,
            embed_scale=float(hf_config.hidden_size) ** 0.5 if gemma else None,
            attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5 if gemma else None,
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None) or None,
            layers=tuple(_layer_spec(hf_config, index, gemma) for index in range(hf_config.num_hidden_layers)),
        )


def architecture_of(hf_config) -> str:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ModelLoadError(
                f"model_type '{model_type}' (no 'architectures' in config.json) is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architectures = [MODEL_TYPES[model_type]]
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ModelLoadError(
            f"architecture '{unsupported[0]}' is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architectures[0]


def _layer_spec(hf_config, index: int, gemma: bool) -> LayerSpec:
    window = getattr(hf_config, "sliding_window", None) or None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        sliding = layer_types[index] == "sliding_attention"
        if layer_types[index] not in ("sliding_attention", "full_attention"):
            raise ModelLoadError(f"layer_types[{index}] '{layer_types[index]}' is not supported")
        window = window if sliding else None
    rope_key = "local" if gemma and window is not None else "global"
    return LayerSpec(sliding_window=window, rope_key=rope_key, moe=_moe_spec(hf_config, index))


def _moe_spec(hf_config, index: int) -> MoeSpec | None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "mixtral":
        return MoeSpec(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size, True, False)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        sparse = (index not in (getattr(hf_config, "mlp_only_layers", None) or [])
                  and hf_config.num_experts > 0 and (index + 1) % hf_config.decoder_sparse_step == 0)
        if not sparse:
            return None
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        return MoeSpec(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       bool(hf_config.norm_topk_prob), True, shared or 0)
    return None
