"""Builds a draft model from the target itself: its first N decoder layers, its final norm and its
LM head (a "layer-skip" draft). No smaller checkpoint of the real model can be downloaded here,
and a draft must share the target's vocabulary; this one does by construction. It is untrained
as a draft (its last layer was never meant to feed the head), so its acceptance rate is what a
cheap, poorly matched drafter gets: the benchmark reports it as such.

Usage: ``python -m backend.spec_decode.truncated_draft --model models/smollm2-135m-instruct
--layers 6 --out models/smollm2-135m-draft6``
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from backend.models.model_folder import read_build_info, write_model_folder

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
BUILDER_VERSION = 1


def build(model: Path, layers: int, out: Path, force: bool = False) -> Path:
    """Writes ``out`` (config.json, model.safetensors, the tokenizer files); a no-op when built alike."""
    config = json.loads((model / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers'] - 1}], got {layers}")
    info = {"source": str(model.resolve()), "layers": layers, "builder_version": BUILDER_VERSION,
            "source_build": read_build_info(model)}
    if not force and read_build_info(out) == info:
        return out

    def write(staging: Path) -> None:
        tensors = {}
        for path in sorted(glob.glob(str(model / "*.safetensors"))):
            for name, tensor in load_file(path).items():
                match = LAYER.match(name)
                if match is None or int(match.group(1)) < layers:
                    tensors[name] = tensor
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2) + "\n")
        for name in os.listdir(model):
            if name.startswith("tokenizer") or name in ("generation_config.json", "chat_template.jinja",
                                                        "special_tokens_map.json", "vocab.json", "merges.txt"):
                shutil.copy2(model / name, staging / name)

    write_model_folder(out, write, info)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m backend.spec_decode.truncated_draft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the target's checkpoint folder")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    print(build(args.model, args.layers, args.out, args.force))


if __name__ == "__main__":
    main()
