"""Speculative decoding through a real tritonserver (issue 17), on `llm` and `llm_iterative`.

The demo model drafts for itself (every proposal accepted), k = 3, the controller off: streamed
text equals the engine's without speculation, each response carries a step's accepted run (more
tokens than responses), a stop string inside a run ends the text where it would without
speculation, a request may turn speculation off, and the llm_spec_decode_* metrics count it.
"""

from __future__ import annotations

import json
import time

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = pytest.mark.integration

SPECULATION = {"speculative_method": "draft", "num_speculative_tokens": "3", "speculative_controller": "off"}
PROMPTS = ["The engine streams tokens", "A block of the cache holds", "Speculation proposes, the target verifies"]


def settled(server, name: str, model: str) -> float:
    """The metric once it stopped moving: engine stats reach Triton's endpoint a little after the
    responses they belong to."""
    value = metric(read_metrics(server), name, model=model)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = metric(read_metrics(server), name, model=model)
        if again == value:
            return value
        value = again
    return value


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_speculative_decoding_streams_the_same_text_in_multi_token_deltas(make_server, demo_model_dir, model):
    offline = LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / model)))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [offline.generate([p], [params])[0] for p in PROMPTS]
    # Coalescing off: a response then carries exactly one step's tokens, so runs come from speculation
    # alone (a lone stream of the tiny demo model still coalesces when the responder falls behind).
    server = make_server({**SPECULATION, "speculative_model_dir": str(demo_model_dir), "response_coalescing": "false"},
                         models=(model,))
    with StreamingClient(server.grpc_url, model) as client:
        results = [client.generate(p, max_tokens=24, ignore_eos=True, stream=True, timeout=120) for p in PROMPTS]
        for want, got in zip(expected, results, strict=True):
            assert got.error is None and got.num_final == 1, got.error
            assert (got.text, got.token_ids) == (want.text, want.output_token_ids)
            assert got.num_responses < len(got.token_ids)  # runs of accepted tokens arrive together
        stop = offline.tokenizer.decode(expected[0].output_token_ids[9:11]).strip()
        want = offline.generate([PROMPTS[0]], [SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])])[0]
        got = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, stream=True, timeout=120, stop_words=[stop])
        assert (got.text, got.finish_reason) == (want.text, "stop")
        before = settled(server, "llm_spec_decode_num_draft_tokens_total", model)
        off = client.generate(PROMPTS[1], max_tokens=24, ignore_eos=True, stream=True, timeout=120,
                              sampling_parameters=json.dumps({"num_speculative_tokens": 0}))
        assert off.text == expected[1].text and off.num_responses == len(off.token_ids)
    drafts = settled(server, "llm_spec_decode_num_draft_tokens_total", model)
    values = read_metrics(server)
    assert drafts == before > 0  # the request that turned it off proposed nothing
    assert metric(values, "llm_spec_decode_num_accepted_tokens_total", model=model) == drafts  # its own draft
    assert metric(values, "llm_spec_decode_num_accepted_tokens_per_pos_total", model=model, position="2") > 0
    assert metric(values, "llm_spec_decode_speculated_step_fraction", model=model) == 1.0
