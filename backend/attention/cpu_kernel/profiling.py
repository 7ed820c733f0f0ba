"""A profiler label around our ctypes kernel calls that costs nothing when no profiler runs.

``torch.profiler.record_function`` costs time on every call even with no profiler active (more
than a decode step's fused RMSNorm itself), and a step makes over a hundred such calls.
perf.profile_step still sees the kernels by name, because it runs the torch profiler.
"""

from __future__ import annotations

import contextlib

import torch

_NO_LABEL = contextlib.nullcontext()


def kernel_label(name: str):
    """``record_function(name)`` while the torch profiler runs, else a shared no-op context."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_LABEL
