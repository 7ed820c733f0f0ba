"""`make setup` run again reinstalls nothing (the venv stamp carries pyproject.toml's hash)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from backend.paths import REPO_ROOT


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_second_setup_does_not_reinstall():
    first = subprocess.run(["make", "setup"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stdout + first.stderr
    second = subprocess.run(["make", "setup"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "pip install" not in second.stdout
    dry = subprocess.run(["make", "-n", "setup"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert "pip install" not in dry.stdout
