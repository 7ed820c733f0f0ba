"""Triton entry point of the `llm_iterative` model: everything lives in backend.triton.iterative_model."""

import os
import sys

# The repository root holds the `backend` package (also when the venv has no editable install).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from backend.triton.iterative_model import TritonPythonModel  # noqa: E402,F401
