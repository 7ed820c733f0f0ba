"""Small random-weight HF checkpoints for tests, built with transformers and saved as safetensors.

Random weights at transformers' default init (std 0.02) give almost flat logits, so greedy
decoding hits near-ties that float rounding can flip. We init with ``INIT_STD`` instead, which
makes logits peaked enough that exact greedy parity is a fair check (no loosened tolerances).
Biases (Qwen2's q/k/v) are zero at init; we randomise them so the bias path is exercised.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

INIT_STD = 0.2  # config.initializer_range of every test model (see the module docstring)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so positions up to ~200 hit all three bands
    "rope_theta": 10000.0,
}

# name -> (config class, model class, config kwargs)
MODEL_SPECS = {
    # (a) Llama, GQA ratio 4
    "llama_gqa4": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024,
    )),
    # (b) Qwen2 style: q/k/v bias, tied embeddings, GQA ratio 2
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )),
    # (c) plain multi-head, llama3 rope scaling, head_dim set explicitly (q_size != hidden_size)
    "llama3_mha": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=48, vocab_size=512, max_position_embeddings=1024,
        rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5,
    )),
    # Mistral architecture, one KV head (GQA ratio 4), no sliding window
    "mistral_1kv": (MistralConfig, MistralForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024, sliding_window=None,
    )),
    # The families of issue 35 (tests/unit/test_model_families.py): a few layers, GQA, small vocabularies.
    # Qwen3: q/k RMSNorm per head, head_dim set (q_size != hidden_size)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, vocab_size=2048, max_position_embeddings=1024,
    )),
    # Qwen3-MoE: 8 experts, top 2 renormalised, the middle layer dense (mlp_only_layers)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], vocab_size=2048, max_position_embeddings=1024,
    )),
    # Qwen2-MoE: q/k/v bias, a shared expert behind a sigmoid gate, top-4 of 6 not renormalised
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=4,
        norm_topk_prob=False, vocab_size=2048, max_position_embeddings=1024,
    )),
    # Mixtral: 4 experts, top 2, every layer a sliding window of 40 positions
    "mixtral_window": (MixtralConfig, MixtralForCausalLM, dict(
        hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=2048,
        max_position_embeddings=1024, sliding_window=40,
    )),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, half the head rotated, longrope
    "phi3_longrope": (Phi3Config, Phi3ForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=4096, original_max_position_embeddings=1024, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
                         "original_max_position_embeddings": 1024},
    )),
    # Llama with yarn rope scaling (an attention factor on cos/sin) from transformers' own rope functions
    "llama_yarn": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "rope_theta": 10000.0},
    )),
    # Gemma 3: sliding layers (window 48, local rotary base) around a global one, GELU-tanh, sandwich
    # norms, scaled embeddings, query_pre_attn_scalar, final logit soft-capping
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=1024,
        sliding_window=48, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )),
}


def make_config(name: str, **overrides):
    config_cls, _, kwargs = MODEL_SPECS[name]
    kwargs = {**kwargs, "initializer_range": INIT_STD, **overrides}
    return config_cls(**kwargs)


def build_random_model(name: str, path: str | os.PathLike, seed: int = 0, max_shard_size: str | None = None,
                       **overrides):
    """Saves a random checkpoint of spec ``name`` into ``path``; returns the float32 HF model (eval)."""
    _, model_cls, _ = MODEL_SPECS[name]
    config = make_config(name, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, INIT_STD)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return model


_TMP_ROOT: str | None = None


@functools.cache
def get_random_model(name: str):
    """(checkpoint folder, float32 HF model) for spec ``name``, built once per test process.

    The qwen2 checkpoint is saved sharded (index + several files) to cover that loader path.
    """
    global _TMP_ROOT
    if _TMP_ROOT is None:
        _TMP_ROOT = tempfile.mkdtemp(prefix="random_models_")
        atexit.register(shutil.rmtree, _TMP_ROOT, True)
    path = os.path.join(_TMP_ROOT, name)
    model = build_random_model(name, path, max_shard_size="300KB" if name == "qwen2_tied" else None)
    return path, model


@functools.cache
def reference_logits(name: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """transformers' float32 logits [len(prompt), vocab] for one prompt (cached per process)."""
    _, model = get_random_model(name)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@functools.cache
def reference_greedy(name: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` tokens after the prompt (stops at EOS; cached)."""
    _, model = get_random_model(name)
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos,
        )
    return out[0, len(prompt) :].tolist()
