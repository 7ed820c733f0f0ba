"""Loads a HF checkpoint folder (config.json + safetensors) of a supported family
(backend/models/family.py) into the decoder of backend/models/llama.py.

Checks come first so a bad checkpoint fails at load with a message naming the problem
(unsupported architecture, activation, RoPE type), never mid-request. Weights stream tensor by
tensor from the safetensors files (single file or sharded index) into parameters allocated once
on the target device; q/k/v and gate/up are copied into the fused ``qkv_proj`` / ``gate_up_proj``
slices (vLLM's stacked-params mapping; Phi's checkpoints are fused already), and each expert's
gate/up/down into its slice of the stacked expert parameters.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from backend.attention.paged import PagedAttentionBackend as AttentionBackend
from backend.attention.selector import get_attention_backend
from backend.models.cpu_linear import probe_packing
from backend.models.family import SUPPORTED_ARCHITECTURES, ModelFamily, ModelLoadError
from backend.models.llama import LlamaForCausalLM
from backend.models.rope import rotary_frequencies
from backend.models.shape import ModelShape
from backend.parallel.shard import TensorShard, check_shardable, shard_checkpoint_tensor

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelLoadError", "load_config", "load_model", "resolve_dtype"]

# checkpoint projection name -> (fused parameter name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# one expert's projection in a checkpoint: Mixtral's w1/w3/w2, Qwen-MoE's gate/up/down
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_TARGET = {"w1": ("experts_gate_up", 0), "gate_proj": ("experts_gate_up", 0), "w3": ("experts_gate_up", 1),
                  "up_proj": ("experts_gate_up", 1), "w2": ("experts_down", None), "down_proj": ("experts_down", None)}


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX), as oneDNN's bfloat16
    GEMMs need to beat float32."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is not None for check in checks):
        return any(check() for check in checks if check is not None)
    try:  # an older torch: the kernel's flags
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """config.pbtxt's ``dtype`` (auto | float32 | bfloat16 | float16) as a torch dtype.

    auto on the CPU: bfloat16 where the CPU multiplies bfloat16 in hardware, else float32: with
    AVX512_BF16 a decode step is faster in bfloat16, without it (bfloat16 emulated) much slower
    (perf/RESULTS.md, "dtype: auto"). bfloat16 greedy output is not token-exact against
    transformers' own bfloat16 (perf.dtype_choice reports the agreement); set float32 for exact
    greedy parity with transformers in float32. On CUDA: the checkpoint's dtype when it is 16-bit,
    else float32.
    """
    explicit = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name in explicit:
        return explicit[name]
    if name != "auto":
        raise ValueError(f"unknown dtype '{name}'")
    if torch.device(device).type == "cpu":
        return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if saved in (torch.bfloat16, torch.float16) else torch.float32


def load_config(model_dir: str, max_model_len: int | None = None) -> PretrainedConfig:
    """Reads config.json (never remote code) and rejects what the Llama forward cannot run."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelLoadError(f"no config.json in model_dir '{model_dir}'")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except ValueError as exc:  # unknown model_type, or one that needs remote code
        raise ModelLoadError(f"cannot read the config of '{model_dir}': {exc}") from exc
    check_config(hf_config, max_model_len)
    return hf_config


def check_config(hf_config: PretrainedConfig, max_model_len: int | None = None) -> None:
    family = ModelFamily.of(hf_config)  # raises for an architecture, activation or option we do not run
    if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
        raise ModelLoadError("pretraining_tp > 1 is not supported")
    shape = ModelShape.of(hf_config)
    for key in sorted({spec.rope_key for spec in family.layers}):
        try:
            inv_freq, _ = rotary_frequencies(hf_config, key, shape.head_size, max_model_len)
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"rope settings: {exc}") from exc
        if 2 * inv_freq.shape[0] > shape.head_size:
            raise ModelLoadError(f"the rotary dimension {2 * inv_freq.shape[0]} exceeds head_dim {shape.head_size}")
    if hf_config.num_attention_heads % shape.num_kv_heads:
        raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")


def _checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in '{model_dir}' (only safetensors checkpoints load)")
    return files


def _parameter_of(ckpt_name: str, qkv_sizes: tuple[int, int, int]):
    """(our parameter's name, a function from that parameter's data to the slice this checkpoint
    tensor fills)."""
    name = ckpt_name.replace(".block_sparse_moe.", ".mlp.")
    expert = _EXPERT.search(name)
    if expert is not None:
        stacked, half = _EXPERT_TARGET[expert.group(2)]
        index = int(expert.group(1))

        def expert_slice(data):
            rows = data[index]
            return rows if half is None else rows.narrow(0, half * (rows.shape[0] // 2), rows.shape[0] // 2)

        return name[: expert.start()] + f".mlp.{stacked}", expert_slice
    for proj, (fused, shard) in _STACKED.items():
        if f".{proj}." in name:
            def fused_slice(data, shard=shard, qkv=fused == "qkv_proj"):
                sizes = qkv_sizes if qkv else (data.shape[0] // 2,) * 2
                return data.narrow(0, sum(sizes[:shard]), sizes[shard])

            return name.replace(f".{proj}.", f".{fused}."), fused_slice
    return name, lambda data: data


def _has_weight(files: list[str], suffix: str) -> bool:
    for path in files:
        with safe_open(path, framework="pt") as f:
            if any(name.endswith(suffix) for name in f.keys()):
                return True
    return False


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend | None = None,
    max_model_len: int | None = None,
    prepack: bool | None = None,
    shard: TensorShard = TensorShard(),
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Builds the model from ``model_dir`` on ``device`` in ``dtype`` and loads its weights.

    ``attn_backend`` defaults to the torch backend; ``max_model_len`` (if known) decides whether a
    sliding-window model can run with full attention; ``prepack`` (default: on the CPU) moves the
    GEMMs onto oneDNN-prepacked weights where that works (see backend.models.cpu_linear); ``shard``
    (a rank of a tensor-parallel group) loads only that rank's part of each tensor
    (backend/parallel/shard.py).
    """
    device = torch.device(device)
    hf_config = load_config(model_dir, max_model_len)
    check_shardable(hf_config, shard.size)
    files = _checkpoint_files(model_dir)
    if attn_backend is None:
        attn_backend = get_attention_backend("auto", device)
    qkv_bias = bool(getattr(hf_config, "attention_bias", False)) or _has_weight(files, "q_proj.bias")
    o_bias = bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = bool(getattr(hf_config, "mlp_bias", False))

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, attn_backend, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                                 shard=shard)
    model.to(dtype)  # still on meta: free
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    pending = {name: param.numel() for name, param in params.items()}  # elements still to load

    shape = model.shape
    qkv_sizes = (shape.q_size, shape.kv_size, shape.kv_size)

    for path in files:
        with safe_open(path, framework="pt") as f:
            for ckpt_name in f.keys():
                if "rotary_emb.inv_freq" in ckpt_name:
                    continue
                if ckpt_name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: logits use the embedding matrix, as transformers does
                name, target_of = _parameter_of(ckpt_name, qkv_sizes)
                param = params.get(name)
                if param is None:
                    logger.warning("ignoring checkpoint tensor %s (no such parameter)", ckpt_name)
                    continue
                tensor = shard_checkpoint_tensor(ckpt_name, f.get_tensor(ckpt_name), shard, model.full_shape)
                target = target_of(param.data)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                pending[name] -= tensor.numel()
    missing = [name for name, left in pending.items() if left > 0]
    if missing:
        raise ModelLoadError(f"checkpoint '{model_dir}' lacks weights for: {', '.join(missing[:8])}")
    model.init_rotary(dtype, device, max_model_len=max_model_len)
    model.eval()
    if prepack is None:
        prepack = device.type == "cpu"
    if prepack and probe_packing(dtype):
        model.prepack_for_cpu()
    return model, hf_config
