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
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from backend.config import parameters_from_pbtxt
from backend.server.launcher import DEFAULT_MODEL_REPOSITORY

PATH_PARAMETERS = ("model_dir", "tokenizer_dir")


def copy_model(source_folder: Path, target: Path, changes: dict[str, str] | None = None, insert_missing: bool = False,
               name: str | None = None, edit: Callable[[str], str] | None = None) -> Path:
    """``target``: a copy of the model folder ``source_folder`` whose config.pbtxt has ``changes``
    (and absolute path parameters); returns ``target``.

    A parameter the config lacks is added when ``insert_missing``, else a KeyError naming it;
    ``name``: the copy is that model (its config's name line); ``edit``: a last change to the
    config's text (a batcher block, say)."""
    source_folder = Path(source_folder).resolve()
    text = (source_folder / "config.pbtxt").read_text(encoding="utf-8")
    if name is not None:
        text, count = re.subn(r'^name: "[^"]*"', f'name: "{name}"', text, count=1, flags=re.M)
        if count != 1:
            raise KeyError(f"config.pbtxt of {source_folder.name!r} has no name line")
    if edit is not None:
        text = edit(text)
    current = parameters_from_pbtxt(text)
    changes = {**{key: str((source_folder / current[key]).resolve()) for key in PATH_PARAMETERS if key in current},
               **(changes or {})}
    for key, value in changes.items():
        pattern = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
        text, count = pattern.subn(lambda m, v=value: m.group(1) + v + m.group(2), text)
        if count == 1:
            continue
        if count > 1 or not insert_missing or "parameters [\n" not in text:
            raise KeyError(f"config.pbtxt of {source_folder.name!r} has no parameter {key!r} to change")
        text = text.replace("parameters [\n", f'parameters [\n  {{ key: "{key}" value: {{ string_value: "{value}" }} }},\n', 1)
    target = Path(target)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source_folder, target, ignore=shutil.ignore_patterns("__pycache__"))
    (target / "config.pbtxt").write_text(text, encoding="utf-8")
    return target


def copy_repository(source: Path, destination: Path, llm_parameters: dict[str, str] | None = None,
                    models: tuple[str, ...] | None = None) -> Path:
    """``destination`` holding ``models`` of ``source`` (default: all), `llm`'s parameters changed
    (added where its config lacks them)."""
    source, destination = Path(source).resolve(), Path(destination)
    names = models or tuple(sorted(p.name for p in source.iterdir() if (p / "config.pbtxt").is_file()))
    destination.mkdir(parents=True, exist_ok=True)
    for model in names:
        llm = model == "llm"
        copy_model(source / model, destination / model, llm_parameters if llm else None, insert_missing=llm)
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
