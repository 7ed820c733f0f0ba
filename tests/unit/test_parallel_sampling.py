"""Parallel sampling (``n`` > 1, issue 16) in the engine: one prompt computed once, n samples.

Sample i of a seeded request equals the same request alone with seed + i, token for token,
whatever else is in the batch and under preemption by a tiny pool; the prompt's blocks are shared
(its prefill tokens are counted once); each sample has its own stop conditions and finish reason;
an abort ends all samples with one output and frees every block.
"""

from __future__ import annotations

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.input_processor import EngineInputError
from backend.engine.llm_engine import LLMEngine
from backend.models.demo_model import DEMO_REPOSITORY
from backend.protocol.sampling import SamplingParams, SamplingParamsError
from backend.protocol.structured_output import parse_structured_outputs

PROMPT = list(range(300, 342))  # 42 tokens: 2 full blocks and a partial one of 10
OTHERS = [list(range(500, 530)), list(range(700, 777))]


def engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides))


def sampled(seed: int, n: int = 1, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, n=n, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLMEngine:
    return engine(enable_prefix_caching="false")


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    return [llm.generate([PROMPT], [sampled(7 + i)])[0].output_token_ids for i in range(4)]


def test_sample_i_equals_the_request_alone_with_seed_plus_i(llm, alone):
    result = llm.generate([PROMPT], [sampled(7, n=4)])[0]
    assert [s.output_token_ids for s in result.samples] == alone
    assert result.output_token_ids == alone[0] and len({tuple(t) for t in alone}) == 4
    assert all(s.finish_reason.value == "length" for s in result.samples)
    mixed = llm.generate([OTHERS[0], PROMPT, OTHERS[1]], [sampled(1), sampled(7, n=4), sampled(2, n=2)])
    assert [s.output_token_ids for s in mixed[1].samples] == alone  # another batch, the same samples
    assert llm.kv_cache_manager.usage == 0.0 and llm.groups == {} and llm.requests == {}


def test_the_prompt_is_computed_once_and_its_blocks_are_shared(llm):
    llm.add_request("g", prompt_token_ids=PROMPT, sampling_params=sampled(3, n=4))
    prefill = 0
    shared_after_fork = None
    while llm.has_unfinished_requests():
        step = llm.step()
        prefill += step.stats.num_prefill_tokens
        if shared_after_fork is None and llm.groups.get("g") is not None and llm.groups["g"].forked:
            shared_after_fork = llm.kv_cache_manager.block_pool.num_shared_references
    assert prefill == len(PROMPT)
    assert shared_after_fork == 3 * 3  # 3 forks x the prompt's 3 blocks
    assert llm.kv_cache_manager.num_copy_on_write >= 3  # the partial block: every writer but the last copies
    assert llm.kv_cache_manager.usage == 0.0


def test_greedy_samples_are_all_the_greedy_output(llm):
    greedy = llm.generate([PROMPT], [SamplingParams(max_tokens=10)])[0].output_token_ids
    result = llm.generate([PROMPT], [SamplingParams(max_tokens=10, n=3)])[0]
    assert [s.output_token_ids for s in result.samples] == [greedy] * 3


def test_each_sample_has_its_own_stop_conditions(llm, alone):
    stop_on = alone[2][3]  # sample 2's fourth token
    result = llm.generate([PROMPT], [sampled(7, n=4, stop_token_ids=[stop_on])])[0]
    for index, sample in enumerate(result.samples):
        tokens = alone[index]
        cut = tokens.index(stop_on) + 1 if stop_on in tokens else len(tokens)
        assert sample.output_token_ids == tokens[:cut]
        assert sample.finish_reason.value == ("stop" if stop_on in tokens else "length")
    assert result.samples[2].finish_reason.value == "stop"


def test_samples_survive_preemption_by_a_tiny_pool(demo_model_dir, alone):
    tiny = engine(enable_prefix_caching="false", num_kv_blocks="14", block_size="16")
    long = [SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True) for i in range(4)]
    expected = [tiny.generate([PROMPT], [p])[0].output_token_ids for p in long]
    params = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=7, n=4, ignore_eos=True)
    result = tiny.generate([PROMPT], [params])[0]
    assert tiny.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in result.samples] == expected
    assert tiny.kv_cache_manager.usage == 0.0


def test_an_abort_ends_every_sample_with_one_output_and_frees_every_block(llm):
    llm.add_request("a", prompt_token_ids=PROMPT, sampling_params=SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    for _ in range(4):
        llm.step()
    assert len(llm.groups["a"].sequences) == 3
    output = llm.abort_request("a")
    assert output.finished and output.finish_reason.value == "abort" and output.request_id == "a"
    assert llm.abort_request("a") is None and not llm.has_unfinished_requests()
    assert llm.kv_cache_manager.usage == 0.0 and llm.requests == {} and llm.groups == {}


def test_bad_n_is_refused_naming_the_field(llm):
    for n in (0, 17, 2.5):
        with pytest.raises((SamplingParamsError, EngineInputError), match="n/num_return_sequences"):
            llm.add_request("bad", prompt_token_ids=PROMPT, sampling_params=SamplingParams(n=n))
    spec = parse_structured_outputs({"regex": "[ab]+"})
    with pytest.raises((SamplingParamsError, EngineInputError), match="n/num_return_sequences"):
        llm.add_request("bad", prompt_token_ids=PROMPT, sampling_params=SamplingParams(n=2, structured_outputs=spec))
