"""Tensor parallelism across GPUs with NCCL (backend/parallel): the demo model at size 2, one rank
per device, gives the greedy tokens of size 1 in float32. Skipped without two CUDA devices (and,
as every test here, without CuPy)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time " * 20, "1, 2, 3,"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for NCCL")
def test_demo_model_at_size_2_on_two_gpus_equals_size_1(demo_model_dir):
    base = engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"))
    tokens = {}
    for size in (1, 2):
        config = dataclasses.replace(base, model=dataclasses.replace(base.model, device="cuda", dtype="float32",
                                                                     tensor_parallel_size=size))
        engine = LLMEngine(config)
        try:
            assert engine.model_runner.device == torch.device("cuda", 0)
            params = SamplingParams(max_tokens=32, ignore_eos=True)
            tokens[size] = [r.output_token_ids for r in engine.generate(PROMPTS, [params] * len(PROMPTS))]
        finally:
            engine.close()
    assert tokens[2] == tokens[1]
