"""Test adapters made by peft itself on a checkpoint: what the LoRA tests (unit and served) load."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ADAPTERS = {  # name -> (rank, target modules, rsLoRA)
    "qv8": (8, ["q_proj", "v_proj"], False),
    "all16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp8rs": (8, ["gate_proj", "up_proj", "down_proj"], True),
    "ok4": (4, ["o_proj", "k_proj"], False),
}
TASK_IDS = {"ok4": 44}  # given in the table; the others get their place in it


def make_adapters(model_dir: str, root: Path, names: tuple[str, ...] | None = None) -> Path:
    """The adapters of ADAPTERS (``names``: only those) on ``model_dir`` (random non-zero B: each
    changes the output), and their multi_lora.json; returns the json's path."""
    import peft  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    for index, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        if names is not None and name not in names:
            continue
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                                 use_rslora=rslora)
        peft.get_peft_model(base, config).save_pretrained(str(root / name))
    table = {name: ({"path": name, "task_id": TASK_IDS[name]} if name in TASK_IDS else name) for name in ADAPTERS
             if names is None or name in names}
    (root / "multi_lora.json").write_text(json.dumps(table))
    return root / "multi_lora.json"
