"""Loads a Llama-family HF checkpoint folder (config.json + safetensors) into LlamaForCausalLM.

Checks come first so a bad checkpoint fails at load with a message naming the problem
(unsupported architecture, activation, RoPE type or sliding window), never mid-request.
Weights stream tensor by tensor from the safetensors files (single file or sharded index) into
parameters allocated once on the target device; q/k/v and gate/up are copied into the fused
``qkv_proj`` / ``gate_up_proj`` slices (vLLM's stacked-params mapping).
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch
from transformers import AutoConfig, PretrainedConfig

from backend.attention.paged import PagedAttentionBackend as AttentionBackend
from backend.models.cpu_linear import probe_packing
from backend.models.llama import LlamaForCausalLM
from backend.models.rope import get_rope_parameters
from backend.models.shape import ModelShape

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# checkpoint projection name -> (fused parameter name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class ModelLoadError(ValueError):
    """The checkpoint cannot be served; the message says why."""


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
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            raise ModelLoadError(
                f"model_type '{model_type}' (no 'architectures' in config.json) is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architectures = [_MODEL_TYPES[model_type]]
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ModelLoadError(
            f"architecture '{unsupported[0]}' is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act '{act}' is not supported (only 'silu')")
    if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
        raise ModelLoadError("pretraining_tp > 1 is not supported")
    try:
        get_rope_parameters(hf_config)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if hf_config.num_attention_heads % ModelShape.of(hf_config).num_kv_heads:
        raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
    _check_sliding_window(hf_config, max_model_len)


def _check_sliding_window(hf_config: PretrainedConfig, max_model_len: int | None) -> None:
    """Full attention equals sliding-window attention while sequences fit in the window."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return
    if getattr(hf_config, "model_type", None) == "qwen2":
        layer_types = getattr(hf_config, "layer_types", None)
        uses_window = getattr(hf_config, "use_sliding_window", False) and (
            layer_types is None or "sliding_attention" in layer_types
        )
        if not uses_window:
            return
    limit = max_model_len or getattr(hf_config, "max_position_embeddings", None)
    if limit is None or window < limit:
        raise ModelLoadError(
            f"sliding_window {window} is smaller than max_model_len {limit}: sliding-window attention "
            f"is not supported; set max_model_len <= {window}"
        )


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


def _has_weight(files: list[str], suffix: str) -> bool:
    from safetensors import safe_open

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
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Builds the model from ``model_dir`` on ``device`` in ``dtype`` and loads its weights.

    ``attn_backend`` defaults to the torch backend; ``max_model_len`` (if known) decides whether a
    sliding-window model can run with full attention; ``prepack`` (default: on the CPU) moves the
    GEMMs onto oneDNN-prepacked weights where that works (see backend.models.cpu_linear).
    """
    from safetensors import safe_open

    from backend.attention.selector import get_attention_backend

    device = torch.device(device)
    hf_config = load_config(model_dir, max_model_len)
    files = _checkpoint_files(model_dir)
    if attn_backend is None:
        attn_backend = get_attention_backend("auto", device)
    qkv_bias = bool(getattr(hf_config, "attention_bias", False)) or _has_weight(files, "q_proj.bias")
    o_bias = bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = bool(getattr(hf_config, "mlp_bias", False))

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, attn_backend, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias)
    model.to(dtype)  # still on meta: free
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    pending: dict[str, int] = {}  # parameter -> number of shards still to load
    for name, param in params.items():
        base = name.rsplit(".", 2)[-2]
        pending[name] = 3 if base == "qkv_proj" else 2 if base == "gate_up_proj" else 1

    shape = model.shape
    qkv_sizes = (shape.q_size, shape.kv_size, shape.kv_size)
    inter = shape.intermediate_size

    for path in files:
        with safe_open(path, framework="pt") as f:
            for ckpt_name in f.keys():
                if "rotary_emb.inv_freq" in ckpt_name:
                    continue
                if ckpt_name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: logits use the embedding matrix, as transformers does
                name, shard = ckpt_name, None
                for proj, (fused, idx) in _STACKED.items():
                    if f".{proj}." in ckpt_name:
                        name, shard = ckpt_name.replace(f".{proj}.", f".{fused}."), idx
                        break
                param = params.get(name)
                if param is None:
                    logger.warning("ignoring checkpoint tensor %s (no such parameter)", ckpt_name)
                    continue
                tensor = f.get_tensor(ckpt_name)
                target = param.data
                if shard is not None:
                    sizes = qkv_sizes if "qkv_proj" in name else (inter, inter)
                    start = sum(sizes[:shard])
                    target = target.narrow(0, start, sizes[shard])
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                pending[name] -= 1
    missing = [name for name, left in pending.items() if left > 0]
    if missing:
        raise ModelLoadError(f"checkpoint '{model_dir}' lacks weights for: {', '.join(missing[:8])}")
    model.init_rotary(dtype, device)
    model.eval()
    if prepack is None:
        prepack = device.type == "cpu"
    if prepack and probe_packing(dtype):
        model.prepack_for_cpu()
    return model, hf_config
