"""Per-token logprobs of greedy requests (``logprobs: k``, issue 16) against transformers.

The chosen token's logprob and the k best (ids and values) at every output position equal the
log-softmax of transformers' float32 logits for the same tokens; with a penalty they follow the
penalised distribution, which is what a request's sampler draws from (backend/runner/sampler.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY

PROMPTS = [[1, *range(100, 160)], [1, 7, 8, 9], [1, *range(400, 437)]]
K = 5
# float32. Measured max difference 3.7e-4 (either attention backend): our forward sums in another
# order than transformers' (fused projections, its own kernels), and the demo model's random
# logits are large; the 1e-4 does not hold for this model, so the bound says what does.
TOLERANCE = 1e-3


@functools.cache
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(DEMO_REPOSITORY.parent / "demo-llama"), dtype=torch.float32)


def reference_logprobs(tokens: list[int], num_prompt: int) -> torch.Tensor:
    """[num outputs, vocab]: log-softmax at the positions that predicted each output token."""
    with torch.no_grad():
        logits = model()(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[num_prompt - 1:len(tokens) - 1], dim=-1)


@pytest.fixture(scope="module")
def engine(demo_model_dir) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), dtype="float32"))


def test_chosen_and_top_k_logprobs_equal_transformers(engine):
    params = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=K, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=PROMPTS[0], sampling_params=params)
    engine.add_request("b", prompt_token_ids=PROMPTS[1], sampling_params=params)
    engine.add_request("c", prompt_token_ids=PROMPTS[2], sampling_params=params)
    collected: dict[str, list] = {"a": [], "b": [], "c": []}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            for token, logprob, top in zip(output.new_token_ids, output.logprobs, output.top_logprobs, strict=True):
                collected[output.request_id].append((token, logprob, top))
    worst = 0.0
    for request_id, prompt in zip("abc", PROMPTS, strict=True):
        rows = collected[request_id]
        expected = reference_logprobs(prompt + [t for t, _, _ in rows], len(prompt))
        for position, (token, logprob, top) in enumerate(rows):
            values, ids = expected[position].topk(K)
            assert token == ids[0].item()  # greedy: the best token
            assert [t for t, _ in top] == ids.tolist()
            worst = max(worst, abs(logprob - expected[position, token].item()),
                        *(abs(v - e) for (_, v), e in zip(top, values.tolist(), strict=True)))
    assert worst < TOLERANCE, worst


def test_with_a_penalty_they_follow_the_penalised_distribution(engine):
    params = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, repetition_penalty=1.3, ignore_eos=True)
    result = engine.generate([PROMPTS[1]], [params])[0]
    tokens = PROMPTS[1] + result.output_token_ids
    with torch.no_grad():
        logits = model()(torch.tensor([tokens])).logits[0].float()
    for position, logprob in enumerate(result.logprobs):
        row = logits[len(PROMPTS[1]) - 1 + position].clone()
        seen = torch.tensor(sorted(set(tokens[:len(PROMPTS[1]) + position])))
        picked = row[seen]
        row[seen] = torch.where(picked > 0, picked / 1.3, picked * 1.3)  # transformers' repetition penalty
        expected = torch.log_softmax(row, dim=-1)
        assert abs(logprob - expected[result.output_token_ids[position]].item()) < TOLERANCE
