"""The decoder layers and the final norm as one loop over the CPU kernels: the same ops as the
modules of backend/models/llama.py, without their per-call Python.

Why: on the CPU a step is one Python thread driving every op while torch's other OpenMP thread
waits, so Python time between ops is paid twice. Before this loop a sizeable share of a decode
step went to the modules' glue (module calls, dtype and layout checks per op, a fresh output
tensor and a ctypes argument conversion per kernel call; perf/RESULTS.md, "A faster CPU step"). Here everything that depends only on the model (weight
pointers, packed weights, shapes) is read once, the checks are made once per forward, and the
kernels write into a few per-step buffers.

Taken when the model runs on the CPU kernels (``use_cpu_kernels``), every projection is prepacked,
the dtype is one the kernels take and the step's tensors are contiguous; otherwise the modules run.
Its results equal the modules' exactly (the same kernels in the same order; tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.attention.base import AttentionMetadata
from backend.attention.cpu_kernel.dtypes import KERNEL_DTYPES
from backend.models.cpu_linear import packed_linear


@dataclass(slots=True)
class _Layer:
    input_norm_weight: int  # data pointers of the norm weights
    post_norm_weight: int
    qkv: tuple  # (packed weight, bias or None)
    o: tuple
    gate_up: tuple
    down: tuple


class CpuDecoderStack:
    """Callable: (hidden [num_tokens, hidden_size] from the embedding, positions, kv_caches, metadata)
    -> the final norm's output [num_tokens, hidden_size]."""

    def __init__(self, model, kernels):
        self.kernels = kernels
        self.model = model
        shape = model.shape
        self.num_heads, self.num_kv_heads, self.head_size = shape.num_heads, shape.num_kv_heads, shape.head_size
        self.q_size, self.kv_size = shape.q_size, shape.kv_size
        self.hidden_size, self.intermediate_size = shape.hidden_size, shape.intermediate_size
        self.scale = self.head_size**-0.5
        layers = model.model.layers
        self.eps = float(layers[0].input_layernorm.eps)
        self.dtype = model.model.embed_tokens.weight.dtype
        self.attn_backend = model.attn_backend
        self.layers = [
            _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   (layer.self_attn.qkv_proj.packed_weight, layer.self_attn.qkv_proj.bias),
                   (layer.self_attn.o_proj.packed_weight, layer.self_attn.o_proj.bias),
                   (layer.mlp.gate_up_proj.packed_weight, layer.mlp.gate_up_proj.bias),
                   (layer.mlp.down_proj.packed_weight, layer.mlp.down_proj.bias))
            for layer in layers
        ]
        self.final_norm_weight = model.model.norm.weight.data_ptr()

    @classmethod
    def build(cls, model, kernels) -> CpuDecoderStack | None:
        """The stack for ``model``, or None where it cannot serve it (the modules run then)."""
        if not model.family.plain or model.rotary.rotary_dim != model.shape.head_size:
            return None  # the stack runs the plain Llama decoder, every head dimension rotated
        layers = list(model.model.layers)
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        weight = model.model.embed_tokens.weight
        if (kernels is None or weight.device.type != "cpu" or weight.dtype not in KERNEL_DTYPES
                or any(m.packed_weight is None for m in linears)
                or len({float(norm.eps) for layer in layers
                        for norm in (layer.input_layernorm, layer.post_attention_layernorm)} | {float(model.model.norm.eps)}) != 1):
            return None
        return cls(model, kernels)

    def takes(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, metadata: AttentionMetadata) -> bool:
        """Whether this step's tensors fit the kernels (checked once per forward, not per op)."""
        rotary = self.model.rotary
        return (hidden.dtype == self.dtype and positions.dtype == torch.int64 and positions.is_contiguous()
                and metadata.slot_mapping.dtype == torch.int64 and metadata.slot_mapping.is_contiguous()
                and rotary.cos_sin_cache.dtype == self.dtype and rotary.cos_sin_cache.is_contiguous()
                and all(k.dtype == self.dtype and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches))

    def __call__(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size], the embedding's output (updated in place as the residual)
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x [num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        kernels, dtype_code, eps = self.kernels, KERNEL_DTYPES[self.dtype], self.eps
        rms_norm, silu_mul, rope_cache = kernels.fused_rms_norm, kernels.fused_silu_mul, kernels.fused_rope_cache
        num_tokens, hidden_size = hidden.shape
        new = lambda *size: torch.empty(size, dtype=self.dtype)  # noqa: E731
        normed, q, k, act = (new(num_tokens, hidden_size), new(num_tokens, self.num_heads, self.head_size),
                             new(num_tokens, self.num_kv_heads, self.head_size),
                             new(num_tokens, self.intermediate_size))
        residual = hidden  # the embedding output becomes the residual stream, updated in place
        p_normed, p_q, p_k, p_act, p_residual = (normed.data_ptr(), q.data_ptr(), k.data_ptr(), act.data_ptr(),
                                                 residual.data_ptr())
        p_positions, p_slots = positions.data_ptr(), metadata.slot_mapping.data_ptr()
        p_cos_sin = self.model.rotary.cos_sin_cache.data_ptr()
        forward = self.attn_backend.forward
        v_start = self.q_size + self.kv_size
        hidden_out = None  # the previous layer's MLP output, added to the residual by the next norm
        hook = self.model.lora_hook
        lora = hook.step if hook is not None else None  # this step's LoRA adapters (backend/lora/step.py)
        reduce = self.model.shard.all_reduce if self.model.shard.sharded else None  # tensor-parallel partial sums
        for index, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if hidden_out is None:  # first layer: the residual is the embedding itself
                rms_norm(dtype_code, p_residual, None, layer.input_norm_weight, p_normed, num_tokens, hidden_size, eps)
            else:  # residual += hidden_out, normed = norm(residual)
                rms_norm(dtype_code, hidden_out.data_ptr(), p_residual, layer.input_norm_weight, p_normed, num_tokens,
                         hidden_size, eps)
            qkv = packed_linear(normed, *layer.qkv)  # [num_tokens, q_size + 2 * kv_size]
            if lora is not None:
                lora.apply((index, "qkv_proj"), normed, qkv)
            rope_cache(dtype_code, qkv.data_ptr(), p_positions, p_cos_sin, p_q, p_k, key_cache.data_ptr(),
                       value_cache.data_ptr(), p_slots, num_tokens, self.num_heads, self.num_kv_heads, self.head_size)
            v = qkv[:, v_start:].view(num_tokens, self.num_kv_heads, self.head_size)
            attn = forward(q, k, v, key_cache, value_cache, metadata, self.scale, cache_written=True)
            attn_out = packed_linear(attn.view(num_tokens, self.q_size), *layer.o)
            if lora is not None:
                lora.apply((index, "o_proj"), attn.view(num_tokens, self.q_size), attn_out)
            if reduce is not None:
                reduce(attn_out)
            rms_norm(dtype_code, attn_out.data_ptr(), p_residual, layer.post_norm_weight, p_normed, num_tokens,
                     hidden_size, eps)
            gate_up = packed_linear(normed, *layer.gate_up)
            if lora is not None:
                lora.apply((index, "gate_up_proj"), normed, gate_up)
            silu_mul(dtype_code, gate_up.data_ptr(), p_act, num_tokens, self.intermediate_size)
            hidden_out = packed_linear(act, *layer.down)
            if lora is not None:
                lora.apply((index, "down_proj"), act, hidden_out)
            if reduce is not None:
                reduce(hidden_out)
        out = new(num_tokens, hidden_size)
        rms_norm(dtype_code, hidden_out.data_ptr(), p_residual, self.final_norm_weight, out.data_ptr(), num_tokens,
                 hidden_size, eps)
        return out
