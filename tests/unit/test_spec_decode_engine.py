"""Speculative decoding in the engine (issue 17), on the demo model in float32.

Greedy output with speculation equals greedy output without it, token for token, for every
proposer and k = 1, 3, 5, in mixed batches (requests that may not speculate beside ones that do),
under preemption by a tiny pool, with prefix-cache hits and chunked prefill. The demo model's
random text rarely repeats, so prompt lookup alone would seldom propose; an oracle proposer (the
known greedy continuation, with every third proposal wrong from its second token on) drives long
accepted runs and partial rejections through the prompt-lookup path, and the draft model is the
demo model itself (every proposal accepted) or its first two layers (most rejected). Stops that
fall inside an accepted run (max_tokens, a stop token, a stop string) end the request where
decoding without speculation does; seeded sampling gives the same tokens with speculation as
without; KV usage of the target's and the draft's pools is back to zero after every run.
"""

from __future__ import annotations

import random

import pytest

from backend.config import ConfigError, engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.models.demo_model import DEMO_REPOSITORY
from backend.protocol.sampling import SamplingParams
from backend.spec_decode.truncated_draft import build as build_truncated_draft
from tests.unit.random_models import get_random_model

rng = random.Random(17)
PROMPTS = [[1] + [rng.randrange(10, 8000) for _ in range(n)] for n in (5, 40, 17, 90, 3, 64)]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
INELIGIBLE = [SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True)]


def engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides))


def speculating(method: str, k: int, draft_dir=None, **overrides: str) -> LLMEngine:
    parameters = {"num_speculative_tokens": str(k), "speculative_controller": "off", **overrides}
    if method == "draft":
        parameters.update(speculative_method="draft", speculative_model_dir=str(draft_dir))
    else:
        parameters.update(speculative_method="ngram", prompt_lookup_min="1")
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **parameters))


class OracleProposer:
    """Proposes the known greedy continuation; every third proposal is wrong from its second token."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.calls = 0

    def propose(self, request, k: int) -> list[int]:
        prompt = tuple(request.prompt_token_ids)
        done = request.num_output_tokens
        proposal = list(self.continuations.get(prompt, [])[done : done + k])
        self.calls += 1
        if self.calls % 3 == 0 and len(proposal) > 1:
            proposal[1:] = [(t + 1) % 8000 + 10 for t in proposal[1:]]
        return proposal

    def release(self, request_id: str) -> None:
        pass

    def keep_only(self, request_ids) -> None:
        pass


@pytest.fixture(scope="module")
def baseline(demo_model_dir):
    llm = engine()
    results = llm.generate(PROMPTS + PROMPTS[:2], [PARAMS] * len(PROMPTS) + INELIGIBLE)
    return [r.output_token_ids for r in results]


@pytest.fixture(scope="module")
def small_draft(demo_model_dir, tmp_path_factory):
    return build_truncated_draft(demo_model_dir, 2, tmp_path_factory.mktemp("draft") / "demo-draft2")


def with_oracle(llm: LLMEngine, prompts, outputs) -> OracleProposer:
    oracle = OracleProposer({tuple(p): o for p, o in zip(prompts, outputs, strict=True)})
    llm.speculator.ngram = oracle
    return oracle


def assert_pools_empty(llm: LLMEngine) -> None:
    assert llm.kv_cache_manager.usage == 0.0
    if llm.speculator.draft is not None:
        assert llm.speculator.draft.usage == 0.0 and not llm.speculator.draft.sequences


def run_mixed(llm: LLMEngine) -> list[list[int]]:
    results = llm.generate(PROMPTS + PROMPTS[:2], [PARAMS] * len(PROMPTS) + INELIGIBLE)
    return [r.output_token_ids for r in results]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", ["oracle", "ngram", "draft: itself", "draft: 2 layers"])
def test_greedy_output_equals_decoding_without_speculation(baseline, demo_model_dir, small_draft, proposer, k):
    if proposer.startswith("draft"):
        llm = speculating("draft", k, demo_model_dir if proposer == "draft: itself" else small_draft)
    else:
        llm = speculating("ngram", k)
        if proposer == "oracle":
            with_oracle(llm, PROMPTS, baseline[: len(PROMPTS)])
    assert run_mixed(llm) == baseline
    stats = llm.stats()
    if proposer != "ngram":
        assert stats.spec_decode_num_draft_tokens > 0
    if proposer in ("oracle", "draft: itself"):
        assert stats.spec_decode_num_accepted_tokens > len(PROMPTS) * k  # runs of accepted tokens, not one a step
        assert stats.spec_decode_accepted_per_position[k - 1] > 0
    if proposer == "draft: itself":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if proposer == "oracle" and k > 1:
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # rejections rolled back
    assert_pools_empty(llm)


SHARED = [1] + [rng.randrange(10, 8000) for _ in range(70)]
CROWDED = [SHARED + [rng.randrange(10, 8000) for _ in range(n)] for n in (4, 9, 30, 2, 15, 22)]
CROWDED_PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("proposer", ["oracle", "draft: itself"])
def test_preemption_prefix_hits_and_chunked_prefill_keep_the_tokens(demo_model_dir, proposer):
    expected = [r.output_token_ids for r in engine().generate(CROWDED, [CROWDED_PARAMS] * len(CROWDED))]
    tight = {"num_kv_blocks": "16", "max_num_batched_tokens": "24"}  # 2 of these requests grow past 15 blocks
    if proposer == "oracle":
        llm = speculating("ngram", 4, **tight)
        with_oracle(llm, CROWDED, expected)
    else:
        llm = speculating("draft", 4, demo_model_dir, speculative_num_kv_blocks="16", **tight)
    got = [r.output_token_ids for r in llm.generate(CROWDED, [CROWDED_PARAMS] * len(CROWDED))]
    assert got == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert_pools_empty(llm)


def _stopping_after_min_tokens(plain: LLMEngine, prompt: list[int], stop_token: int) -> SamplingParams:
    """min_tokens 12 masks the stop ids (and there is no speculation) until 12 outputs; then a
    second stop id, one that first appears after those 12, ends the request inside a run."""
    masked = plain.generate([prompt], [SamplingParams(max_tokens=30, min_tokens=12, stop_token_ids=[stop_token])])[0]
    tokens = masked.output_token_ids
    later = next(t for i, t in enumerate(tokens) if i >= 14 and t not in tokens[:i])
    return SamplingParams(max_tokens=30, min_tokens=12, stop_token_ids=[stop_token, later])


def test_stops_inside_an_accepted_run_end_where_decoding_without_speculation_does(demo_model_dir):
    plain = engine()
    llm = speculating("draft", 5, demo_model_dir)  # every proposal accepted: six tokens a step
    prompt = PROMPTS[1]
    full = plain.generate([prompt], [SamplingParams(max_tokens=30, ignore_eos=True)])[0]
    stop_token = full.output_token_ids[9]
    stop_text = plain.tokenizer.decode(full.output_token_ids[8:10])
    cases = [SamplingParams(max_tokens=7, ignore_eos=True), SamplingParams(max_tokens=13, ignore_eos=True),
             SamplingParams(max_tokens=30, stop_token_ids=[stop_token]),
             SamplingParams(max_tokens=30, stop=[stop_text.strip() or stop_text]),
             _stopping_after_min_tokens(plain, prompt, stop_token)]
    for params in cases:
        want = plain.generate([prompt], [params])[0]
        got = llm.generate([prompt], [params])[0]
        assert (got.output_token_ids, got.text, got.finish_reason) == (want.output_token_ids, want.text,
                                                                      want.finish_reason), params
        assert len(got.output_token_ids) < 30
        assert_pools_empty(llm)  # after every request
    assert llm.stats().spec_decode_accepted_per_position[4] > 0
    assert_pools_empty(llm)


@pytest.mark.parametrize("proposer", ["oracle", "draft: itself"])
def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(baseline, demo_model_dir, proposer):
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i)
              for i in range(len(PROMPTS))]
    expected = [r.output_token_ids for r in engine().generate(PROMPTS, params)]
    if proposer == "oracle":
        llm = speculating("ngram", 3)
        with_oracle(llm, PROMPTS, expected)
    else:
        llm = speculating("draft", 3, demo_model_dir)
    assert [r.output_token_ids for r in llm.generate(PROMPTS, params)] == expected
    assert llm.stats().spec_decode_num_accepted_tokens > 0
    assert_pools_empty(llm)


def test_unseeded_sampling_with_a_draft_completes_and_frees_its_blocks(small_draft):
    llm = speculating("draft", 3, small_draft)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, top_k=50)
    results = llm.generate(PROMPTS, [params] * len(PROMPTS))
    assert all(len(r.output_token_ids) == 20 and r.error is None for r in results)
    assert llm.stats().spec_decode_num_draft_tokens > 0
    assert_pools_empty(llm)


def test_the_controller_measures_step_times_and_keeps_greedy_output(baseline, demo_model_dir):
    llm = speculating("draft", 3, demo_model_dir, speculative_controller="auto")
    model = llm.speculator.controller.step_time
    assert model is not None and len(model.tokens) >= 5 and all(s > 0 for s in model.seconds)
    assert run_mixed(llm) == baseline
    stats = llm.stats()
    assert stats.spec_decode_num_steps > 0 and 0 <= stats.spec_decode_num_speculated_steps <= stats.spec_decode_num_steps
    assert_pools_empty(llm)


def test_num_speculative_tokens_zero_in_a_request_turns_speculation_off(baseline, demo_model_dir):
    llm = speculating("draft", 3, demo_model_dir)
    params = SamplingParams(max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    assert [r.output_token_ids for r in llm.generate(PROMPTS, [params] * len(PROMPTS))] == baseline[: len(PROMPTS)]
    assert llm.stats().spec_decode_num_draft_tokens == 0
    one = SamplingParams(max_tokens=24, ignore_eos=True, num_speculative_tokens=1)
    llm.generate(PROMPTS[:1], [one])
    stats = llm.stats()
    assert 0 < stats.spec_decode_num_draft_tokens == stats.spec_decode_accepted_per_position[0]


def test_a_failing_proposer_costs_only_the_speculation(baseline, demo_model_dir):
    class Broken(OracleProposer):
        def propose(self, request, k):
            raise RuntimeError("proposer bug")

    llm = speculating("ngram", 3)
    llm.speculator.ngram = Broken({})
    assert run_mixed(llm) == baseline
    assert llm.stats().spec_decode_num_draft_tokens == 0


def test_configuration_errors_name_the_parameter(demo_model_dir):
    with pytest.raises(ConfigError, match="speculative_model_dir"):
        engine(speculative_method="draft")
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        engine(speculative_method="ngram", prompt_lookup_min="4", prompt_lookup_max="2")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        engine(speculative_method="ngram", num_speculative_tokens="17")
    other_vocabulary, _ = get_random_model("llama_gqa4")
    with pytest.raises(ConfigError, match="speculative_model_dir.*vocabulary"):
        engine(speculative_method="draft", speculative_model_dir=str(other_vocabulary))
    with pytest.raises(ConfigError, match="speculative_model_dir"):
        engine(speculative_method="draft", speculative_model_dir="/nonexistent/draft")


def test_rejected_positions_leave_no_blocks_and_no_hashes_behind(baseline):
    """After every step: a running request holds the blocks of its computed tokens, at most those
    of its known ones (none for rejected proposals), and
    only blocks full of kept tokens carry a prefix-cache hash (the request's own chain), also when
    proposals ran into the next block and were rejected there (k = 5, every third proposal wrong)."""
    llm = speculating("ngram", 5)
    with_oracle(llm, PROMPTS, baseline[: len(PROMPTS)])
    for index, prompt in enumerate(PROMPTS):
        llm.add_request(f"r{index}", prompt_token_ids=prompt, sampling_params=PARAMS)
    manager, size = llm.kv_cache_manager, llm.kv_cache_manager.block_size
    crossed = 0
    while llm.has_unfinished_requests():
        step = llm.step()
        crossed += sum(1 for o in step.outputs if len(o.new_token_ids) > 1)
        for request in llm.scheduler.running:
            blocks = manager.req_to_blocks[request.request_id]
            assert -(-request.num_computed_tokens // size) <= len(blocks) <= -(-request.num_tokens // size)
            for i, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert (i + 1) * size <= request.num_computed_tokens
                    assert block.block_hash == request.kv.block_hashes[i]
    assert crossed > 0 and llm.stats().spec_decode_num_accepted_tokens < llm.stats().spec_decode_num_draft_tokens
    assert manager.usage == 0.0
