"""The decoder stack on the CPU kernels (backend/models/cpu_stack.py) against the modules it replaces.

The stack runs the same kernels in the same order as the modules with the kernels set, so its
output must be identical (torch.equal, both dtypes), over a step that mixes decodes, whole prompts
and a chunk after a cached prefix, for a GQA model and a tied-embedding model with q/k/v biases.
Against the modules without kernels (torch's ops) float32 agrees to 1e-4 (summation orders).
"""

from __future__ import annotations

import pytest
import torch

from backend.attention.cpu_backend import CpuAttentionBackend
from backend.engine.request import Request
from backend.models.cpu_linear import probe_packing
from backend.models.cpu_stack import CpuDecoderStack
from backend.models.loader import load_model
from backend.protocol.sampling import SamplingParams
from backend.runner.model_runner import ModelRunner
from backend.runner.scheduled import ScheduledRequest as Scheduled
from tests.kernels.conftest import both_builds
from tests.unit.random_models import get_random_model


def step(runner: ModelRunner, vocab_size: int):
    """Two steps' inputs on the same cache: prompts first, then decodes plus a chunk after a prefix."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (5, 40, 70)]
    requests = [Request(str(i), p, SamplingParams()) for i, p in enumerate(prompts)]
    tables = [[3, 1, 8], [2, 9, 4, 11], [5, 6, 7, 10, 12]]
    first = [Scheduled(requests[0], 5, 0, tables[0]), Scheduled(requests[1], 40, 0, tables[1]),
             Scheduled(requests[2], 30, 0, tables[2])]
    for request in requests[:2]:
        request.append_output_token(7)
    second = [Scheduled(requests[0], 1, 5, tables[0]), Scheduled(requests[1], 1, 40, tables[1]),
              Scheduled(requests[2], 40, 30, tables[2])]
    return [runner.prepare(first)[:3], runner.prepare(second)[:3]]


@pytest.fixture(params=["native", "avx2"])
def kernels(request, cpu_kernels):
    """This CPU's build and the build without AVX-512 (tests/kernels/conftest.py)."""
    return both_builds(request, cpu_kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama_gqa4", "qwen2_tied"])
def test_the_stack_equals_the_modules_on_the_kernels(kernels, name, dtype):
    cpu_kernels = kernels
    path, hf_config = get_random_model(name)
    if not probe_packing(dtype):  # e.g. bf16 where oneDNN has no AVX-512 BF16: nothing is prepacked
        model, _ = load_model(path, dtype, torch.device("cpu"), CpuAttentionBackend(cpu_kernels))
        model.use_cpu_kernels(cpu_kernels)
        assert model.cpu_stack is None  # so the stack never serves: the modules on the kernels do
        assert all(m.packed_weight is None for m in model.modules() if hasattr(m, "packed_weight"))
        return
    results = []
    for use_stack in (True, False, None):  # stack; modules with kernels; modules with torch's ops
        backend = CpuAttentionBackend(cpu_kernels)
        model, _ = load_model(path, dtype, torch.device("cpu"), backend)
        if use_stack is not None:
            model.use_cpu_kernels(cpu_kernels)
            assert model.cpu_stack is not None
            if not use_stack:
                model.cpu_stack = None  # the modules, each on its kernel
        runner = ModelRunner(model, 16, 16)
        steps = step(runner, hf_config.vocab_size)
        if use_stack:  # the stack really runs (it would fall back to the modules silently otherwise)
            hidden = model.model.embed_tokens(steps[0][0])
            assert all(model.cpu_stack.takes(hidden, positions, runner.kv_caches, metadata)
                       for _, positions, metadata in steps)
        outputs = [model(input_ids, positions, runner.kv_caches, metadata) for input_ids, positions, metadata in steps]
        results.append((outputs, [c.clone() for pair in runner.kv_caches for c in pair]))
    (stack_out, stack_cache), (module_out, module_cache), (torch_out, _) = results
    for a, b in zip(stack_out, module_out, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(stack_cache, module_cache, strict=True):
        assert torch.equal(a, b)
    if dtype == torch.float32:
        for a, b in zip(stack_out, torch_out, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_stack_is_not_built_without_kernels_or_packed_weights(cpu_kernels):
    path, _ = get_random_model("llama_gqa4")
    model, _ = load_model(path, torch.float32, torch.device("cpu"), CpuAttentionBackend(cpu_kernels), prepack=False)
    model.use_cpu_kernels(cpu_kernels)
    assert model.cpu_stack is None  # projections not prepacked: the modules run
    model, _ = load_model(path, torch.float32, torch.device("cpu"), CpuAttentionBackend(cpu_kernels))
    assert CpuDecoderStack.build(model, None) is None
    assert CpuDecoderStack.build(model, cpu_kernels) is not None
