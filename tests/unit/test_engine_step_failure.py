"""A step that raises fails the requests in flight (each gets its final output) and leaves the engine usable."""

from __future__ import annotations

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY


def test_step_or_fail_all_ends_every_request_with_the_error_and_keeps_serving(demo_model_dir):
    engine = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for index in range(3):
        engine.add_request(f"r{index}", prompt_token_ids=[1, 10 + index, 20, 30], sampling_params=params)
    assert engine.step_or_fail_all().outputs  # a healthy step: tokens, no error

    def broken_step(timings=False):
        raise RuntimeError("boom in the forward pass")

    engine.step = broken_step
    outputs = engine.step_or_fail_all().outputs
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    for output in outputs:
        assert output.finished and output.finish_reason is FinishReason.ERROR
        assert "internal error during generation" in output.error and "boom in the forward pass" in output.error
    assert not engine.has_unfinished_requests()

    del engine.step  # the class's step again
    result = engine.generate([[1, 5, 6, 7]], [params])[0]
    assert result.output_token_ids and len(result.output_token_ids) == 4


def _engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides))


def test_out_of_vocabulary_stop_token_ids_are_refused_at_the_door(demo_model_dir):
    """Issue 20: one such id used to reach the sampler's min-tokens mask and fail every request in flight."""
    import pytest

    from backend.engine.llm_engine import EngineInputError

    engine = _engine()
    vocab = engine.vocab_size
    for bad in (99999999, 2**70, vocab, -1):
        params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5, bad])
        with pytest.raises(EngineInputError, match=r"^stop_token_ids: .* not a token id"):
            engine.add_request(f"bad-{bad}", prompt_token_ids=[1, 2, 3], sampling_params=params)
    assert not engine.has_unfinished_requests()
    engine.add_request("edge", prompt_token_ids=[1, 2, 3],
                       sampling_params=SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[0, vocab - 1]))
    while engine.has_unfinished_requests():
        engine.step_or_fail_all()


def test_a_row_the_sampler_cannot_handle_fails_only_its_own_request(demo_model_dir):
    engine = _engine()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 10 + i, 20, 30 + i] for i in range(4)]
    expected = [r.output_token_ids for r in engine.generate(prompts, [params] * 4)]

    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling_params=params)
    # Break request r2 behind the door's back: an id the sampler's min-tokens mask cannot index.
    poisoned = engine.requests["r2"].sampling_params = SamplingParams(
        max_tokens=6, min_tokens=3, ignore_eos=True, stop_token_ids=[10**8]
    )
    assert poisoned.stop_token_ids == [10**8]
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step_or_fail_all().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                finals[output.request_id] = output
    assert finals["r2"].finish_reason is FinishReason.ERROR
    assert "IndexError" in finals["r2"].error and "Traceback" not in finals["r2"].error
    for index in (0, 1, 3):
        assert finals[f"r{index}"].error is None and finals[f"r{index}"].finish_reason is FinishReason.LENGTH
        assert tokens[f"r{index}"] == expected[index]


def test_a_failed_forward_fails_the_requests_of_that_step_and_spares_the_waiting_ones(demo_model_dir):
    engine = _engine(max_num_seqs="2")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [[1, 40 + i, 41, 42] for i in range(3)]
    expected = engine.generate([prompts[2]], [params])[0].output_token_ids

    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, sampling_params=params)
    runner_execute = engine.model_runner.execute

    def fail_once(scheduled, timings=None):
        engine.model_runner.execute = runner_execute
        raise RuntimeError("device fault")

    engine.model_runner.execute = fail_once
    outputs = engine.step_or_fail_all().outputs
    assert sorted(o.request_id for o in outputs) == ["r0", "r1"]
    assert all(o.finish_reason is FinishReason.ERROR and "device fault" in o.error for o in outputs)
    assert engine.kv_cache_manager.usage == 0.0  # r0 and r1 freed everything they held
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step_or_fail_all().outputs:
            assert output.request_id == "r2" and output.error is None
            tokens.extend(output.new_token_ids)
    assert tokens == expected


def test_a_request_failing_after_the_forward_leaves_the_prefix_cache_to_everyone_else(demo_model_dir):
    """One bad request must not cost the others their prefix hits (only a failed forward may have
    left hashed blocks without their KV)."""
    engine = _engine()
    prefix = list(range(100, 148))  # three full 16-token blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("good", prompt_token_ids=[1, *prefix, 7], sampling_params=params)
    engine.add_request("bad", prompt_token_ids=[1, 9, 9, 9], sampling_params=params)
    engine.requests["bad"].sampling_params = SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[10**8])
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step_or_fail_all().outputs if o.finished})
    assert finals["bad"].finish_reason is FinishReason.ERROR and finals["good"].error is None
    hits_before = engine.stats().prefix_cache_hits
    engine.generate([[1, *prefix, 8]], [params])
    assert engine.stats().prefix_cache_hits - hits_before == 48  # the good request's blocks were kept
