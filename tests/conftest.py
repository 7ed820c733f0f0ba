"""Shared fixtures: the demo model (built once, deterministically) and the repository root.

Fast tests run the served configuration on the tiny demo model: ``DEMO_REPOSITORY`` is
model_repository with only the model parameters changed (backend/models/demo_model.py writes it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.models.demo_model import DEMO_REPOSITORY  # noqa: F401  (re-exported for the tests)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from backend.models.demo_model import DEFAULT_OUT, build, write_demo_repository

    folder = build(DEFAULT_OUT)
    write_demo_repository()  # from this checkout's model_repository, so config edits are tested at once
    return folder
