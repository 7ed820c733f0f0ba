"""GPU checks of the cupy attention backend: they run where CuPy and a CUDA device are present
and are skipped otherwise, with the reason (pytest -ra lists it).

tests/gpu/check_all.py runs them all in a few minutes on a lent GPU machine.
"""

from __future__ import annotations

import pytest

from backend.attention.cupy_backend import cupy_available

GPU_OK, GPU_REASON = cupy_available()


@pytest.fixture(scope="session", autouse=True)
def _needs_cupy_and_a_gpu() -> None:
    if not GPU_OK:
        pytest.skip(f"needs CuPy and a CUDA device: {GPU_REASON}")
