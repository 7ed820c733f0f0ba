"""About a minute (KERNEL_E2E=0 skips it): the real engine on the CPU with the cupy backend's
kernels emulated generates exactly the greedy tokens of the torch backend.

The same prompts as the GPU parity test (tests/gpu/test_greedy_parity_gpu.py): a shared prefix,
a prompt longer than one decode partition, chunked prefill over three steps.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("KERNEL_E2E") == "0", reason="KERNEL_E2E=0: end-to-end run with emulated kernels skipped"
)


@pytest.mark.slow
def test_engine_greedy_parity_with_emulated_kernels(tmp_path, monkeypatch):
    import backend.attention.selector as selector
    from backend.attention.cupy_backend import CupyAttentionBackend
    from tests.gpu import test_greedy_parity_gpu as gpu_test
    from tests.kernels.conftest import emulated_launch, emulated_module

    model_dir = gpu_test.build_small_model(tmp_path / "demo-small")
    parse = gpu_test.parse_engine_config
    monkeypatch.setattr(gpu_test, "parse_engine_config", lambda params: parse({**params, "device": "cpu"}))
    expected = gpu_test.greedy(model_dir, "torch", "float32")

    class EmulatedCupy(CupyAttentionBackend):
        name = "torch"  # greedy() checks the engine kept the backend it was asked for

    monkeypatch.setattr(
        selector,
        "get_attention_backend",
        lambda name, device, *_args, **_kwargs: EmulatedCupy("cpu", module_factory=emulated_module, launch=emulated_launch),
    )
    assert gpu_test.greedy(model_dir, "torch", "float32") == expected
