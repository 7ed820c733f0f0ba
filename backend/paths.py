"""Where the repository is: the one definition of its root, for the launcher, builders, tests and benchmarks."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
