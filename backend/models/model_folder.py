"""Writing a model folder all at once: built in a staging folder beside it, then swapped in, so a
half-written build (an interrupted ``make setup``) never replaces or poses as a good one.
Used by the demo model and the SmolLM2 conversion."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

BUILD_INFO = "build_info.json"  # what a build was made from: a changed one triggers a rebuild


def write_model_folder(out: Path, write: Callable[[Path], None], build_info: dict) -> None:
    """Calls ``write(staging)``, records ``build_info`` in it, then replaces ``out`` with it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(staging)
        (staging / BUILD_INFO).write_text(json.dumps(build_info, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_build_info(out: Path) -> dict | None:
    try:
        return json.loads((out / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def parse_build_args(prog: str, description: str, default_out: Path, argv: list[str] | None) -> argparse.Namespace:
    """The build commands' options: --out (the folder) and --force (build even if it is there)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--force", action="store_true", help="build again even if an identical build exists")
    return parser.parse_args(argv)
