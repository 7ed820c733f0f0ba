"""Shared fixtures: the demo model (built once, deterministically) and the repository root."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from backend.demo_model import DEFAULT_OUT, build

    return build(DEFAULT_OUT)
