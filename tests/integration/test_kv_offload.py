"""The KV offload disk tier through a real tritonserver (issue 19), on `llm` and `llm_iterative`.

A tiny pool evicts a long shared prefix between its requests: with the disk tier it comes back
from disk (the restored-blocks counter says so) and the text equals the engine's without a tier;
after the server is stopped and started again on the same folder, the first request with that
prefix loads it from disk and still gives the same text.
"""

from __future__ import annotations

import random

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.engine.request import SamplingParams
from client.stream import StreamingClient
from tests.integration.conftest import MODEL_REPOSITORY
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = pytest.mark.integration

POOL = {"num_kv_blocks": "40", "block_size": "16"}
rng = random.Random(19)
WORDS = "the a model server token batch stream cache block prefix engine core text disk tier".split()
PREFIX = " ".join(rng.choice(WORDS) for _ in range(260))
FILLERS = [" ".join(rng.choice(WORDS[::-1]) + str(i) for _ in range(200)) for i in range(3)]


def ask(server, model: str, prompt: str) -> str:
    with StreamingClient(server.grpc_url, model) as client:
        result = client.generate(prompt, max_tokens=8, ignore_eos=True, stream=True, timeout=120)
    assert result.error is None and len(result.token_ids) == 8, result.error
    return result.text


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_an_evicted_prefix_returns_from_disk_and_survives_a_restart(make_server, demo_model_dir, tmp_path, model):
    offline = LLMEngine(engine_config_from_model_folder(str(MODEL_REPOSITORY / model), **POOL))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [PREFIX + " first question", *FILLERS, PREFIX + " second question", PREFIX + " after restart"]
    expected = [offline.generate([p], [params])[0].text for p in prompts]
    parameters = {**POOL, "kv_offload_tier": "disk", "kv_offload_dir": str(tmp_path / "tier"),
                  "kv_offload_load_policy": "always"}
    server = make_server(parameters, models=(model,))
    assert [ask(server, model, p) for p in prompts[:5]] == expected[:5]
    values = read_metrics(server)
    assert metric(values, "llm_kv_offload_stored_blocks_total", model=model) > 0
    restored = metric(values, "llm_kv_offload_restored_blocks_total", model=model)
    assert restored >= len(offline.tokenizer(PREFIX)["input_ids"]) // 16 - 1
    assert metric(values, "llm_kv_offload_load_seconds_count", model=model) >= 1
    server.stop()
    again = make_server(parameters, models=(model,))
    assert ask(again, model, prompts[5]) == expected[5]
    assert metric(read_metrics(again), "llm_kv_offload_restored_blocks_total", model=model) > 0
