"""The decoder-only causal LM every supported family runs on, over the paged KV cache.

Llama 2/3, Mistral, Qwen2, SmolLM are this decoder as it is; Qwen3, Phi-3/4, Gemma 3 and the
mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) switch on what their
:class:`ModelFamily` says (q/k norms, Gemma's norms and scaled embeddings, the activation,
sliding-window layers with their own rotary table, partial rotary, sparse MLPs).

The batch is flattened: ``input_ids`` and ``positions`` hold every scheduled token of every
sequence back to back, with no padding; the attention backend finds sequence boundaries in
:class:`AttentionMetadata`. Projections are fused for speed (vLLM's layout): ``qkv_proj`` stacks
q/k/v and ``gate_up_proj`` stacks gate/up; :mod:`backend.models.loader` concatenates the
checkpoint's weights into them. Arithmetic follows transformers' order (RMSNorm in float32, cast,
then weight; cos/sin computed in float32) so greedy tokens match ``generate()``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from backend.attention.base import AttentionMetadata
from backend.attention.paged import PagedAttentionBackend as AttentionBackend
from backend.models import cpu_fused
from backend.models.activation import activation_fn
from backend.models.cpu_linear import Linear, packed_linear, prepack_weight
from backend.models.cpu_stack import CpuDecoderStack
from backend.models.family import LayerSpec, ModelFamily
from backend.models.moe import SparseMoeBlock
from backend.models.rope import RotaryEmbedding, rotary_frequencies
from backend.models.shape import ModelShape
from backend.parallel.shard import TensorShard, local_shape


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (returns the new residual too)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.kernels = None  # the CPU kernels (backend/models/cpu_fused.py), set by use_cpu_kernels

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ):
        if self.kernels is not None and cpu_fused.takes(x, self.weight, *(() if residual is None else (residual,))):
            out = cpu_fused.rms_norm(self.kernels, x, self.weight, self.eps, residual)  # residual += x in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual + x
            residual = x
        if x.dtype == torch.float32:
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        else:  # transformers' order: normalise in float32, cast back, then scale
            x32 = x.float()
            normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        out = self.weight * normed
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), both in float32, then casts (transformers' order)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden_size] -> same
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(family: ModelFamily, size: int, eps: float) -> nn.Module:
    return GemmaRMSNorm(size, eps) if family.gemma_norm else RMSNorm(size, eps)


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them unless tensor-parallel, see backend/parallel)."""

    def __init__(self, hf_config, attn_backend: AttentionBackend, qkv_bias: bool, o_bias: bool,
                 family: ModelFamily | None = None, spec: LayerSpec | None = None, shape: ModelShape | None = None):
        super().__init__()
        spec = spec or LayerSpec(sliding_window=None, rope_key="global", moe=None)  # None: plain Llama attention
        shape = shape or ModelShape.of(hf_config)
        self.num_heads, self.num_kv_heads, self.head_size = shape.num_heads, shape.num_kv_heads, shape.head_size
        self.q_size, self.kv_size = shape.q_size, shape.kv_size
        self.scale = (family and family.attention_scale) or self.head_size**-0.5
        self.sliding_window = spec.sliding_window
        self.rope_key = spec.rope_key
        self.qkv_proj = Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)
        if family is not None and family.qk_norm:  # per head, before rotary (Qwen3, Gemma 3)
            self.q_norm = make_norm(family, self.head_size, hf_config.rms_norm_eps)
            self.k_norm = make_norm(family, self.head_size, hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn_backend = attn_backend
        self.kernels = None  # the CPU kernels (backend/models/cpu_fused.py), set by use_cpu_kernels

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rotary: RotaryEmbedding,
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_size)
        if self.kernels is not None and rotary.rotary_dim == self.head_size \
                and cpu_fused.takes(qkv, rotary.cos_sin_cache, *kv_cache) and positions.dtype == torch.int64:
            if self.q_norm is not None:  # normalised heads written back in place, then the fused pass
                qkv[:, : self.q_size] = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_size)).view(
                    num_tokens, self.q_size)
                qkv[:, self.q_size : self.q_size + self.kv_size] = self.k_norm(
                    qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.head_size)).view(
                    num_tokens, self.kv_size)
            # rotary embedding and the cache write in one pass (the backend then skips its write)
            q, k = cpu_fused.rope_cache(self.kernels, qkv, positions, rotary.cos_sin_cache, kv_cache[0], kv_cache[1],
                                        metadata.slot_mapping, self.num_heads)
            out = self.attn_backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale,
                                            cache_written=True, sliding_window=self.sliding_window)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_size))
            k = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_size))
            qk = torch.cat((q.view(num_tokens, self.num_heads, self.head_size),
                            k.view(num_tokens, self.num_kv_heads, self.head_size)), dim=1)
        qk = rotary(positions, qk)  # q and k heads rotated in one go
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn_backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale,
                                        sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, bias: bool, intermediate_size: int | None = None, activation: str = "silu"):
        super().__init__()
        self.intermediate_size = intermediate_size or hf_config.intermediate_size
        self.gate_up_proj = Linear(hf_config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, hf_config.hidden_size, bias=bias)
        self.activation = activation
        self.act = activation_fn(activation)
        self.kernels = None  # the CPU kernels (backend/models/cpu_fused.py), set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if self.kernels is not None and self.activation == "silu" and cpu_fused.takes(gate_up):
            return self.down_proj(cpu_fused.silu_mul(self.kernels, gate_up))
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        return self.down_proj(self.act(gate) * up)


def make_mlp(hf_config, family: ModelFamily, spec: LayerSpec, bias: bool, shard: TensorShard) -> nn.Module:
    """The layer's MLP with this rank's share of its intermediate dimension; its partial sums are
    all-reduced once (by the dense MLP's down_proj, or by the sparse block for all its experts)."""
    if spec.moe is None:
        mlp = LlamaMLP(hf_config, bias, hf_config.intermediate_size // shard.size, family.activation)
        mlp.down_proj.reduce = shard.all_reduce if shard.sharded else None
        return mlp
    moe = dataclasses.replace(spec.moe, intermediate_size=spec.moe.intermediate_size // shard.size,
                              shared_intermediate_size=spec.moe.shared_intermediate_size // shard.size)
    shared = (LlamaMLP(hf_config, bias, moe.shared_intermediate_size, family.activation)
              if moe.shared_intermediate_size else None)
    block = SparseMoeBlock(hf_config.hidden_size, moe, family.activation, shared)
    block.reduce = shard.all_reduce if shard.sharded else None
    return block


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 family: ModelFamily, spec: LayerSpec, shape: ModelShape, shard: TensorShard):
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.sandwich = family.gemma_norm  # Gemma: norms after attention and around the MLP, plain residual adds
        self.input_layernorm = make_norm(family, hf_config.hidden_size, eps)
        self.self_attn = LlamaAttention(hf_config, attn_backend, qkv_bias, o_bias, family, spec, shape)
        self.self_attn.o_proj.reduce = shard.all_reduce if shard.sharded else None
        self.post_attention_layernorm = make_norm(family, hf_config.hidden_size, eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(family, hf_config.hidden_size, eps)
            self.post_feedforward_layernorm = make_norm(family, hf_config.hidden_size, eps)
        self.mlp = make_mlp(hf_config, family, spec, mlp_bias, shard)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None in the first layer
        rotary: RotaryEmbedding,
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sandwich:  # returns the residual stream itself (and None)
            attended = self.self_attn(self.input_layernorm(hidden), rotary, positions, kv_cache, metadata)
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))), None
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, positions, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 family: ModelFamily, shape: ModelShape, shard: TensorShard):
        super().__init__()
        vocab_rows = shard.vocab_rows(hf_config.vocab_size)[1]  # this rank's share (all of it alone)
        # Given an empty weight, nn.Embedding skips its random init, whose meta-device path imports
        # torch._dynamo (most of a second of every engine start).
        self.embed_tokens = nn.Embedding(vocab_rows, hf_config.hidden_size,
                                         _weight=torch.empty(vocab_rows, hf_config.hidden_size))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, attn_backend, qkv_bias, o_bias, mlp_bias, family, spec, shape, shard)
            for spec in family.layers
        )
        self.norm = make_norm(family, hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The causal LM: embeddings, decoder layers over the paged KV cache, final norm, lm_head.

    Build it through :func:`backend.models.loader.load_model`; the constructor allocates
    uninitialised parameters (on the meta device when called under ``torch.device('meta')``).
    With a ``shard`` of a tensor-parallel group it holds that rank's part of every layer and calls
    the group's collectives (backend/parallel/shard.py); ``shape`` is then the rank's own.
    """

    def __init__(
        self,
        hf_config,
        attn_backend: AttentionBackend,
        qkv_bias: bool = False,
        o_bias: bool = False,
        mlp_bias: bool = False,
        shard: TensorShard = TensorShard(),
    ):
        super().__init__()
        self.config = hf_config
        self.shard = shard
        self.full_shape = ModelShape.of(hf_config)
        self.shape = local_shape(self.full_shape, shard)
        self.family = ModelFamily.of(hf_config)
        self.attn_backend = attn_backend
        self.model = LlamaModel(hf_config, attn_backend, qkv_bias, o_bias, mlp_bias, self.family, self.shape, shard)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None  # logits use model.embed_tokens.weight
        else:
            self.lm_head = Linear(hf_config.hidden_size, shard.vocab_rows(hf_config.vocab_size)[1], bias=False)
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary() once the device is known
        self.rotaries: dict[str, RotaryEmbedding] = {}  # by LayerSpec.rope_key ("global" is self.rotary)
        self.embed_scale: torch.Tensor | None = None  # Gemma: sqrt(hidden_size) in the model dtype
        self.logits_packed: torch.Tensor | None = None  # tied lm_head, oneDNN-packed (CPU), see prepack_for_cpu
        self.cpu_stack = None  # the decoder layers as one loop over the CPU kernels (cpu_stack.py), see use_cpu_kernels
        self.lora_hook = None  # the running step's LoRA adapters (backend/lora/step.py), see attach_lora

    def init_rotary(self, dtype: torch.dtype, device: torch.device, initial_len: int = 4096,
                    max_model_len: int | None = None) -> None:
        """Builds the cos/sin caches, one per rotary table the layers use, and the embedding scale
        (derived state, never in a checkpoint)."""
        max_pos = getattr(self.config, "max_position_embeddings", None) or initial_len
        for key in sorted({spec.rope_key for spec in self.family.layers} | {"global"}):
            inv_freq, scaling = rotary_frequencies(self.config, key, self.shape.head_size, max_model_len)
            self.rotaries[key] = RotaryEmbedding(None, self.shape.head_size, dtype, device,
                                                 initial_len=min(initial_len, max_pos), inv_freq=inv_freq,
                                                 scaling=scaling)
        self.rotary = self.rotaries["global"]
        if self.family.embed_scale is not None:
            self.embed_scale = torch.tensor(self.family.embed_scale).to(dtype=dtype, device=device)

    def prepack_for_cpu(self) -> bool:
        """Runs every projection and lm_head on oneDNN-prepacked weights (see cpu_linear)."""
        layers = [m for m in self.modules() if isinstance(m, Linear)]
        experts = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        if not all(layer.prepack() for layer in layers) or not all(block.prepack() for block in experts):
            for layer in layers:
                layer.packed_weight = None
            for block in experts:
                block.packed = None
            return False
        if self.lm_head is None:  # tied: pack the embedding matrix once more for the logits GEMM
            self.logits_packed = prepack_weight(self.model.embed_tokens.weight)
        return True

    def attach_lora(self, hook) -> None:
        """Every adapted projection adds ``hook.step``'s LoRA deltas (backend/lora/step.py)."""
        self.lora_hook = hook
        for index, layer in enumerate(self.model.layers):
            for name, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                                 ("gate_up_proj", getattr(layer.mlp, "gate_up_proj", None)),
                                 ("down_proj", getattr(layer.mlp, "down_proj", None))):
                if linear is not None:  # a sparse MLP has no single gate_up/down projection
                    linear.lora_hook, linear.lora_key = hook, (index, name)

    def use_cpu_kernels(self, kernels) -> int:
        """Runs every RMSNorm, SiLU x up, rotary embedding + cache write and sparse MLP's experts
        through the CPU kernels; returns how many modules."""
        modules = [m for m in self.modules() if isinstance(m, (RMSNorm, LlamaMLP, LlamaAttention))]
        for module in modules:
            module.kernels = kernels
        experts = [m for m in self.modules() if isinstance(m, SparseMoeBlock) and m.use_kernels(kernels)]
        self.cpu_stack = CpuDecoderStack.build(self, kernels)
        return len(modules) + len(experts)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x [num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        for rotary in self.rotaries.values():
            rotary.ensure_len(metadata.max_seq_len)
        hidden = self.embed(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.cpu_stack is not None and self.cpu_stack.takes(hidden, positions, kv_caches, metadata):
            return self.cpu_stack(hidden, positions, kv_caches, metadata)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            rotary = self.rotaries[layer.self_attn.rope_key]
            hidden, residual = layer(hidden, residual, rotary, positions, kv_cache, metadata)
        if residual is None:  # Gemma's layers hand back the residual stream itself
            return self.model.norm(hidden)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64 -> [num_tokens, hidden_size]
        """The embedding; tensor-parallel, each rank looks up the ids in its vocabulary rows and the
        sum over ranks fills in the rest."""
        if not self.shard.sharded:
            return self.model.embed_tokens(input_ids)
        first, held, _ = self.shard.vocab_rows(self.full_shape.vocab_size)
        local = input_ids - first
        outside = (local < 0) | (local >= held)
        hidden = F.embedding(local.clamp(0, held - 1), self.model.embed_tokens.weight)
        hidden.masked_fill_(outside.unsqueeze(1), 0)
        return self.shard.all_reduce(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # hidden: [n, hidden_size] -> [n, vocab] float32
        """The logits; tensor-parallel, every rank computes its vocabulary columns and rank 0 gets
        them all (the other ranks get None)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.logits_packed is not None:
            logits = packed_linear(hidden, self.logits_packed, None)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        cap = self.family.final_logit_softcapping
        if cap is not None:  # Gemma's tanh soft-capping, in the model dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        if self.shard.sharded:
            logits = self.shard.gather_columns(logits)
            if logits is None:
                return None
            logits = logits[:, : self.full_shape.vocab_size]
        return logits.float()

