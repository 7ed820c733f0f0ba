"""The import rules hold: pyproject.toml's contracts ([tool.importlinter], import-linter's own check),
ruff's rules, and a reason on every import left inside a function."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from backend.paths import REPO_ROOT


def tool_command(name: str) -> list[str]:
    """The venv's ``name`` (beside this interpreter), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return [str(beside)] if beside.exists() else [shutil.which(name) or name]


def test_every_import_contract_is_kept():
    result = subprocess.run([*tool_command("lint-imports"), "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


LAZY_IMPORT_REASON = re.compile(r"#\s*noqa:[^(]*PLC0415[^(]*\((optional|process): \S")


def lazy_imports_without_a_reason() -> list[str]:
    """Every import inside a function (ruff's PLC0415, checked in CI) says why it is not at the top:
    an optional dependency, or a process that must not load it yet (see docs/architecture.md)."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    missing = []
    for name in files:
        if name.startswith("tests/"):
            continue
        for number, line in enumerate((REPO_ROOT / name).read_text(encoding="utf-8").splitlines(), start=1):
            if "PLC0415" in line and not LAZY_IMPORT_REASON.search(line):
                missing.append(f"{name}:{number}: {line.strip()}")
    return missing


def test_every_lazy_import_says_which_process_or_optional_dependency_needs_it():
    missing = lazy_imports_without_a_reason()
    assert not missing, "\n".join(missing)


def test_ruff_passes_with_its_import_rules():
    """pyproject.toml's ruff rules (import order, PLC0415: no import inside a function without a noqa)
    over the tree, as `make lint` runs them."""
    result = subprocess.run([*tool_command("ruff"), "check", "--no-cache", "."], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
