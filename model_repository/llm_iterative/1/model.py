"""Triton entry point of the `llm_iterative` model: everything lives in backend.triton.iterative_model."""

import os
import sys

# The `backend` package lives in a folder above this one (also when the venv has no editable install;
# copies of this repository elsewhere, e.g. models/demo-repository, find it the same way).
_here = os.path.dirname(os.path.abspath(__file__))
while _here != os.path.dirname(_here) and not os.path.isfile(os.path.join(_here, "backend", "__init__.py")):
    _here = os.path.dirname(_here)
sys.path.insert(0, _here)

from backend.triton.iterative_model import TritonPythonModel  # noqa: E402,F401
