"""step() reports what it did: exact prompt and decode token counts per step of a scripted batch,
preemptions, and phase timings when asked (perf/ and tests read these instead of patching internals)."""

from __future__ import annotations

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY


def engine_with(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides))


@pytest.fixture(scope="module")
def budget16(demo_model_dir):
    return engine_with(max_num_batched_tokens="16", enable_prefix_caching="false")


def counts(step):
    s = step.stats
    return (s.num_seqs, s.num_prefill_tokens, s.num_decode_tokens, s.num_sampled, s.num_preempted)


def test_token_counts_per_step_of_a_scripted_batch(budget16):
    engine = budget16
    engine.add_request("a", prompt_token_ids=list(range(10, 20)), sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", prompt_token_ids=list(range(30, 50)), sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    # (seqs, prefill tokens, decode tokens, sampled, preempted)
    assert [counts(s) for s in steps] == [
        (2, 16, 0, 1, 0),  # a's 10-token prompt, then 6 of b's 20 (budget 16); only a samples
        (2, 14, 1, 2, 0),  # a decodes; b's last 14 prompt tokens, and b samples
        (2, 0, 2, 2, 0),  # both decode; a ends at 3 tokens, b at 2
    ]
    assert steps[0].stats.timings is None
    assert [sum(len(o.new_token_ids) for o in s.outputs) for s in steps] == [1, 2, 2]


def test_preemptions_are_counted_in_the_step_that_made_them(demo_model_dir):
    # 4 usable blocks of 16 tokens: two 30-token prompts fill them; the first to need a 3rd
    # block preempts the other.
    engine = engine_with(num_kv_blocks="5", enable_prefix_caching="false", max_num_batched_tokens="64")
    for name, first in (("a", 100), ("b", 200)):
        engine.add_request(name, prompt_token_ids=list(range(first, first + 30)),
                           sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    preempted = 0
    while engine.has_unfinished_requests():
        preempted += engine.step().stats.num_preempted
    assert preempted == engine.stats().num_preemptions > 0


def test_phase_timings_when_asked(budget16):
    engine = budget16
    engine.add_request("t", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    step = engine.step(timings=True)
    timings = step.stats.timings
    assert set(timings) == {"schedule", "prepare", "forward", "logits", "sample", "detokenize"}
    assert all(seconds >= 0 for seconds in timings.values()) and timings["forward"] > 0
    while engine.has_unfinished_requests():
        engine.step()
