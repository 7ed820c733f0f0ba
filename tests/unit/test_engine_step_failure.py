"""A step that raises fails the requests in flight (each gets its final output) and leaves the engine usable."""

from __future__ import annotations

from backend.config import engine_config_from_model_folder
from backend.engine import LLMEngine
from backend.request import FinishReason, SamplingParams
from tests.conftest import REPO_ROOT


def test_step_or_fail_all_ends_every_request_with_the_error_and_keeps_serving(demo_model_dir):
    engine = LLMEngine(engine_config_from_model_folder(str(REPO_ROOT / "model_repository" / "llm")))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for index in range(3):
        engine.add_request(f"r{index}", prompt_token_ids=[1, 10 + index, 20, 30], sampling_params=params)
    assert engine.step_or_fail_all()  # a healthy step: tokens, no error

    def broken_step():
        raise RuntimeError("boom in the forward pass")

    engine.step = broken_step
    outputs = engine.step_or_fail_all()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    for output in outputs:
        assert output.finished and output.finish_reason is FinishReason.ERROR
        assert "internal error during generation" in output.error and "boom in the forward pass" in output.error
    assert not engine.has_unfinished_requests()

    del engine.step  # the class's step again
    result = engine.generate([[1, 5, 6, 7]], [params])[0]
    assert result.output_token_ids and len(result.output_token_ids) == 4
