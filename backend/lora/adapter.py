"""One PEFT LoRA adapter folder, checked and loaded into the model's fused projection layout.

PEFT's format: ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``...) and ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` tensors
(A: [r, in_features], B: [out_features, r]). The delta of a targeted module is
``scaling * x @ A.T @ B.T`` with scaling ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``).

Our model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (backend/models/llama.py),
so an adapter is stored per layer and fused projection as one A, the parts' A stacked
([parts x r, in]), and one B, block-diagonal with the scaling folded in ([out, parts x r]); a part
the adapter does not target is zeros there. What we cannot serve is refused at load with the reason:
DoRA, other PEFT types, bias or embedding/lm_head weights, modules the model does not have,
per-module rank or alpha patterns, a rank above ``max_lora_rank``, a file that does not load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from backend.lora.registry import AdapterEntry, LoRAConfigError
from backend.models.shape import ModelShape
from backend.parallel.shard import shard_checkpoint_tensor

# fused projection -> its parts (checkpoint module names), in the fused layout's order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
MODULES = tuple(part for parts in FUSED.values() for part in parts)
PART_OF = {part: fused for fused, parts in FUSED.items() for part in parts}
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
# adapter_config.json keys that change the computation, and the only values we implement
MUST_BE = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
           "lora_bias": (False, None), "modules_to_save": (None, []), "layers_to_transform": (None, []),
           "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "megatron_config": (None,),
           "layer_replication": (None, []), "trainable_token_indices": (None, {}, [])}


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    digest: str  # sha256 of the weights file: what a cached KV block of this adapter is keyed by
    targets: tuple[str, ...]  # checkpoint module names it changes
    # (layer, fused projection) -> (A [parts x rank, in], B [out, parts x rank], scaling folded into B)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # fused projection -> its parts' output columns as offsets ((0, q, q + kv, q + 2 kv) for qkv_proj)
    part_columns: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _fused_sizes(shape: ModelShape) -> dict[str, tuple[int, tuple[int, ...]]]:
    """fused projection -> (in_features, each part's out_features)."""
    kv = shape.kv_size
    return {"qkv_proj": (shape.hidden_size, (shape.q_size, kv, kv)), "o_proj": (shape.q_size, (shape.hidden_size,)),
            "gate_up_proj": (shape.hidden_size, (shape.intermediate_size, shape.intermediate_size)),
            "down_proj": (shape.intermediate_size, (shape.hidden_size,))}


def read_adapter_config(entry: AdapterEntry, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scaling, targeted modules) of the folder's adapter_config.json; LoRAConfigError naming
    the adapter and the reason for anything we cannot serve."""
    where = f"adapter {entry.name!r} ({entry.path})"
    try:
        with open(os.path.join(entry.path, CONFIG_FILE), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAConfigError(f"{where}: no readable {CONFIG_FILE} ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise LoRAConfigError(f"{where}: peft_type {config.get('peft_type') if isinstance(config, dict) else None!r}; "
                              "only LORA adapters are supported")
    for key, allowed in MUST_BE.items():
        if key in config and config[key] not in allowed:
            raise LoRAConfigError(f"{where}: {key} {config[key]!r} is not supported (only {allowed[0]!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAConfigError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAConfigError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAConfigError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise LoRAConfigError(f"{where}: target_modules as a regular expression is not supported; list the modules")
    if not isinstance(targets, list) or not targets:
        raise LoRAConfigError(f"{where}: target_modules must be a non-empty list")
    unknown = sorted(set(targets) - set(MODULES))
    if unknown:
        raise LoRAConfigError(f"{where}: target module {unknown[0]!r} is not one this model adapts "
                              f"(supported: {', '.join(MODULES)})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), tuple(t for t in MODULES if t in targets)


def load_adapter(entry: AdapterEntry, shape: ModelShape, max_rank: int, dtype: torch.dtype,
                 device: torch.device, shard=None, local: ModelShape | None = None) -> LoRAAdapter:
    """The adapter in ``entry``'s folder, checked against ``shape`` (the whole model's), in the fused
    layout. A tensor-parallel ``shard`` (``local``: its shape) keeps its part, sliced like the layer
    it adapts: B by output rows where the layer is column-parallel (q/k/v, gate/up), A by input
    columns where it is row-parallel (o, down; the rank's partial delta is summed with the layer's)."""
    rank, scaling, targets = read_adapter_config(entry, max_rank)
    where = f"adapter {entry.name!r} ({entry.path})"
    path = os.path.join(entry.path, WEIGHTS_FILE)
    try:
        with open(path, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        tensors = load_file(path)
    except FileNotFoundError:
        raise LoRAConfigError(f"{where}: no {WEIGHTS_FILE} (only safetensors weights are read)") from None
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise LoRAConfigError(f"{where}: {WEIGHTS_FILE} does not load ({type(exc).__name__}: {exc})") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.fullmatch(key)
        if match is None or match.group(3) not in MODULES:
            raise LoRAConfigError(f"{where}: weight {key!r} is not a LoRA A/B of a module this model adapts "
                                  "(embedding, lm_head and bias weights are not supported)")
        layer, module, which = int(match.group(1)), match.group(3), match.group(4)
        if layer >= shape.num_layers or module not in targets:
            raise LoRAConfigError(f"{where}: weight {key!r} does not fit (layer {layer} of {shape.num_layers}, "
                                  f"targets {', '.join(targets)})")
        parts.setdefault((layer, module), {})[which] = tensor
    sizes = _fused_sizes(shape)
    local_sizes = _fused_sizes(local or shape)
    sharded = shard is not None and shard.sharded
    adapter = LoRAAdapter(entry.name, rank, scaling, digest, targets)
    for fused, (_, outs) in local_sizes.items():
        adapter.part_columns[fused] = tuple(sum(outs[:index]) for index in range(len(outs) + 1))
    for layer in range(shape.num_layers):
        for fused, names in FUSED.items():
            if not any(name in targets for name in names):
                continue
            in_features, outs = sizes[fused]
            row_parallel = fused in ("o_proj", "down_proj")
            a = torch.zeros(len(names) * rank, local_sizes[fused][0], dtype=torch.float32)
            b = torch.zeros(sum(local_sizes[fused][1]), len(names) * rank, dtype=torch.float32)
            row = 0
            for index, (name, out_features) in enumerate(zip(names, local_sizes[fused][1], strict=True)):
                if name in targets:
                    pair = parts.get((layer, name), {})
                    if set(pair) != {"A", "B"}:
                        raise LoRAConfigError(f"{where}: layer {layer} {name} lacks lora_{'A' if 'A' not in pair else 'B'}")
                    whole_out = outs[index]
                    if tuple(pair["A"].shape) != (rank, in_features) or tuple(pair["B"].shape) != (whole_out, rank):
                        raise LoRAConfigError(
                            f"{where}: layer {layer} {name}: lora_A {tuple(pair['A'].shape)} and lora_B "
                            f"{tuple(pair['B'].shape)} do not fit [{rank}, {in_features}] and [{whole_out}, {rank}]")
                    lora_a, lora_b = pair["A"], pair["B"]
                    if sharded:  # named as the layer's weight, so the layer's rule slices it
                        weight_name = f"model.layers.{layer}.x.{name}.weight"
                        if row_parallel:
                            lora_a = shard_checkpoint_tensor(weight_name, lora_a, shard, shape)
                        else:
                            lora_b = shard_checkpoint_tensor(weight_name, lora_b, shard, shape)
                    a[index * rank:(index + 1) * rank] = lora_a.float()
                    b[row:row + out_features, index * rank:(index + 1) * rank] = lora_b.float() * scaling
                row += out_features
            adapter.weights[(layer, fused)] = (a.to(device=device, dtype=dtype).contiguous(),
                                               b.to(device=device, dtype=dtype).contiguous())
    return adapter
