"""A copy of one model of a model repository with some config.pbtxt parameters changed.

perf.compare runs the same engine settings in-process and behind Triton; when a run changes a
parameter (``--dtype bfloat16``), the server must load the changed config too. Triton reads
parameters only from config.pbtxt, so this writes a copy of the model's folder with the new values
and with ``model_dir``/``tokenizer_dir`` made absolute (they are relative to the model folder).
The copy's model.py imports ``backend`` from the editable install that ``make setup`` makes.
Every benchmark that serves a changed config writes it here (perf/served.py starts the server).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from backend.config import parameters_from_pbtxt

PATH_PARAMETERS = ("model_dir", "tokenizer_dir")


def repository_with_overrides(source: Path, model: str, overrides: dict[str, str], destination: Path,
                              name: str | None = None, edit: Callable[[str], str] | None = None) -> Path:
    """Writes ``destination/model`` (config.pbtxt with ``overrides`` applied); returns ``destination``.

    ``name``: the copy is that model instead (folder and config name); ``edit``: a last change to
    the config's text (a batcher block, say)."""
    source_folder = Path(source) / model
    text = (source_folder / "config.pbtxt").read_text(encoding="utf-8")
    if name is not None:
        text, count = re.subn(r'^name: "[^"]*"', f'name: "{name}"', text, count=1, flags=re.M)
        if count != 1:
            raise KeyError(f"config.pbtxt of {model!r} has no name line")
    if edit is not None:
        text = edit(text)
    current = parameters_from_pbtxt(text)
    changes = dict(overrides)
    for key in PATH_PARAMETERS:
        if key in current and key not in changes:
            changes[key] = str((source_folder / current[key]).resolve())
    for key, value in changes.items():
        pattern = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
        text, count = pattern.subn(lambda m, v=value: m.group(1) + v + m.group(2), text)
        if count != 1:
            raise KeyError(f"config.pbtxt of {model!r} has no parameter {key!r} to override")
    target = Path(destination) / (name or model)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source_folder, target, ignore=shutil.ignore_patterns("__pycache__"))
    (target / "config.pbtxt").write_text(text, encoding="utf-8")
    return Path(destination)
