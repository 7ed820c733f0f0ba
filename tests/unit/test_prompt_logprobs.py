"""prompt_logprobs (vLLM's key, k = 0): the logprob of every prompt token given the ones before it, equal
to transformers' in float32 whether the prompt is one chunk or many, whether its prefix is cached or
not (a prompt_logprobs request recomputes it), and through a preemption."""

from __future__ import annotations

import functools

import pytest
import torch

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams, SamplingParamsError
from tests.conftest import DEMO_REPOSITORY

PROMPTS = [[1, *range(100, 300)], [1, 5, 6, 7, 8, 9], [1, *range(100, 180), 42, 43]]  # the third shares a prefix
TOLERANCE = 2e-3  # float32, summation order of a different kernel


@functools.cache
def reference(prompt: tuple[int, ...]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DEMO_REPOSITORY.parent / "demo-llama"), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]


def engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides))


def check(results) -> None:
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt) - 1
        expected = reference(tuple(prompt))
        assert max(abs(a - b) for a, b in zip(result.prompt_logprobs, expected, strict=True)) < TOLERANCE


@pytest.mark.parametrize("budget", ["1024", "64", "7"])  # one chunk; several; many tiny ones
def test_prompt_logprobs_equal_transformers(demo_model_dir, budget):
    check(engine(max_num_batched_tokens=budget).generate(PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=0)))


def test_a_cached_prefix_is_recomputed_for_a_prompt_logprobs_request(demo_model_dir):
    llm = engine()
    llm.generate(PROMPTS, SamplingParams(max_tokens=1))  # the prefixes are cached now
    hits = llm.kv_cache_manager.prefix_hits
    check(llm.generate(PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=0)))
    assert llm.kv_cache_manager.prefix_hits == hits
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))[0].prompt_logprobs is None  # only when asked


def test_prompt_logprobs_survive_preemption_and_arrive_once(demo_model_dir):
    llm = engine(num_kv_blocks="20", block_size="16", max_num_batched_tokens="48")
    params = SamplingParams(max_tokens=60, ignore_eos=True, prompt_logprobs=0)
    for index, prompt in enumerate(PROMPTS):
        llm.add_request(f"r{index}", prompt_token_ids=prompt, sampling_params=params)
    seen: dict[str, list] = {}
    while llm.has_unfinished_requests():
        for output in llm.step().outputs:
            if output.prompt_logprobs is not None:
                seen.setdefault(output.request_id, []).append(output.prompt_logprobs)
    assert llm.scheduler.num_preemptions > 0
    assert sorted(seen) == ["r0", "r1", "r2"] and all(len(v) == 1 for v in seen.values())
    for index, prompt in enumerate(PROMPTS):
        values = seen[f"r{index}"][0]
        assert max(abs(a - b) for a, b in zip(values, reference(tuple(prompt)), strict=True)) < TOLERANCE


def test_only_zero_is_supported():
    with pytest.raises(SamplingParamsError, match="prompt_logprobs: only 0"):
        SamplingParams(prompt_logprobs=5).validate()
