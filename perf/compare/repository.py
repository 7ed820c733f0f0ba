"""A copy of one model of a model repository with some config.pbtxt parameters changed.

perf.compare runs the same engine settings in-process and behind Triton; when a run changes a
parameter (``--dtype bfloat16``), the server must load the changed config too. Triton reads
parameters only from config.pbtxt, so this writes a copy of the model's folder with the new values
and with ``model_dir``/``tokenizer_dir`` made absolute (they are relative to the model folder).
The copy's model.py imports ``backend`` from the editable install that ``make setup`` makes.
Every benchmark that serves a changed config writes it here (perf/served.py starts the server).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backend.server.repository_copy import copy_model


def repository_with_overrides(source: Path, model: str, overrides: dict[str, str], destination: Path,
                              name: str | None = None, edit: Callable[[str], str] | None = None) -> Path:
    """Writes ``destination/model`` (config.pbtxt with ``overrides`` applied, each one a parameter
    the config has); returns ``destination``.

    ``name``: the copy is that model instead (folder and config name); ``edit``: a last change to
    the config's text (a batcher block, say)."""
    copy_model(Path(source) / model, Path(destination) / (name or model), overrides, name=name, edit=edit)
    return Path(destination)
