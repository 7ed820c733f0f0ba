"""The import contracts of pyproject.toml ([tool.importlinter]) hold: import-linter's own check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from backend.paths import REPO_ROOT


def lint_imports_command() -> list[str]:
    beside = Path(sys.executable).parent / "lint-imports"
    return [str(beside)] if beside.exists() else [shutil.which("lint-imports") or "lint-imports"]


def test_every_import_contract_is_kept():
    result = subprocess.run([*lint_imports_command(), "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
