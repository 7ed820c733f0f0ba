"""Where the repository is (the one definition of its root, for the launcher, builders, tests and
benchmarks) and which interpreter our child processes start with."""

import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def python_executable() -> str:
    """The interpreter to start a child process (the engine core, a fork server) with: ours. Inside
    Triton's stub ``sys.executable`` may name the stub binary, so then the ``python3`` first on PATH
    (the venv's: the stub finds its site-packages the same way)."""
    candidates = [sys.executable, os.path.join(sys.exec_prefix, "bin", "python3"), shutil.which("python3")]
    for candidate in candidates:
        if candidate and os.path.basename(candidate).startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("no python interpreter found to start a child process with")
