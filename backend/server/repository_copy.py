"""A copy of a model repository with some `llm` parameters changed: how one repository serves as
many replicas, each with its own KV-events port (backend/server/replicas.py, docker-compose.yml).

Triton reads parameters only from config.pbtxt, so each replica gets its own copy of the model
folders; ``model_dir`` and ``tokenizer_dir`` become absolute (they are relative to the model's
folder). Each model's ``1/model.py`` finds the ``backend`` package in a folder above itself or in
the editable install: place the copy inside this repository's tree (``models/`` in the compose
file) where there is no editable install.

Command line: ``python -m backend.server.repository_copy --out DIR [--source model_repository]
[--models llm,tokenizer] [--set NAME=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from backend.config import parameters_from_pbtxt
from backend.models.demo_model import set_parameters
from backend.server.launcher import DEFAULT_MODEL_REPOSITORY

PATH_PARAMETERS = ("model_dir", "tokenizer_dir")


def copy_repository(source: Path, destination: Path, llm_parameters: dict[str, str] | None = None,
                    models: tuple[str, ...] | None = None) -> Path:
    """``destination`` holding ``models`` of ``source`` (default: all), `llm`'s parameters changed."""
    source, destination = Path(source).resolve(), Path(destination)
    names = models or tuple(sorted(p.name for p in source.iterdir() if (p / "config.pbtxt").is_file()))
    destination.mkdir(parents=True, exist_ok=True)
    for model in names:
        folder = destination / model
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(source / model, folder, ignore=shutil.ignore_patterns("__pycache__"))
        text = (folder / "config.pbtxt").read_text(encoding="utf-8")
        current = parameters_from_pbtxt(text)
        changes = {key: str((source / model / current[key]).resolve()) for key in PATH_PARAMETERS if key in current}
        if model == "llm":
            changes |= llm_parameters or {}
        (folder / "config.pbtxt").write_text(set_parameters(text, changes, insert_missing=model == "llm"),
                                             encoding="utf-8")
    return destination


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.server.repository_copy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="", help="comma-separated model names (default: every model)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an `llm` parameter")
    args = parser.parse_args(argv)
    changes = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--set: expected NAME=VALUE, got {item!r}")
        changes[name] = value
    models = tuple(m for m in args.models.split(",") if m) or None
    print(copy_repository(args.source, args.out, changes, models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
