"""Beam search (``beam_width``, issue 16) through tritonserver, `llm` and `llm_iterative`.

TensorRT-LLM's inputs (``beam_width``, ``length_penalty``, ``early_stopping``) and the same keys
in ``sampling_parameters`` give the engine's beams; nothing streams before the search ends, then
one final response (n = 1) or one per beam with ``sequence_index`` (n > 1, streamed) or one with
all n beams (n > 1, not streamed); a setting that does not apply is refused by name.
"""

from __future__ import annotations

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY

pytestmark = pytest.mark.integration

PROMPT = "beams fork and share their blocks"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def expected(demo_model_dir) -> list[str]:
    engine = LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / "llm")))
    params = SamplingParams(max_tokens=MAX_TOKENS, beam_width=4, n=3, length_penalty=0.5)
    return [sample.text for sample in engine.generate([PROMPT], [params])[0].samples]


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_beam_width_4_returns_the_engines_beams(triton_server, expected, model):
    with StreamingClient(triton_server.grpc_url, model) as client:
        best = client.generate(PROMPT, stream=True, beam_width=4, length_penalty=0.5, max_tokens=MAX_TOKENS,
                               timeout=120)
        three = client.generate(PROMPT, stream=False, timeout=120, sampling_parameters={
            "beam_width": 4, "n": 3, "length_penalty": 0.5, "max_tokens": MAX_TOKENS})
        streamed = client.generate(PROMPT, stream=True, timeout=120, sampling_parameters={
            "beam_width": 4, "n": 3, "length_penalty": 0.5, "max_tokens": MAX_TOKENS})
    assert best.error is None and best.num_final == 1 and best.num_responses == 1  # nothing before the end
    assert best.text == expected[0]
    assert three.error is None and three.num_responses == 1
    assert [three.sample_texts[i] for i in range(3)] == expected
    assert streamed.error is None and streamed.num_final == 1 and streamed.num_responses == 3
    assert [streamed.sample_texts[i] for i in range(3)] == expected


def test_a_setting_that_does_not_apply_is_refused_by_name(triton_server):
    with StreamingClient(triton_server.grpc_url) as client:
        result = client.generate(PROMPT, beam_width=2, temperature=0.8, timeout=60)
        too_many = client.generate(PROMPT, sampling_parameters={"beam_width": 2, "n": 3}, timeout=60)
    assert result.error is not None and "temperature: does not apply to beam search" in result.error
    assert too_many.error is not None and "must be <= beam_width" in too_many.error
