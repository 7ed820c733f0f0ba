"""The KV offload disk tier through a real tritonserver (issue 19), on `llm` and `llm_iterative`.

A tiny pool evicts a long shared prefix between its requests: with the disk tier it comes back
from disk (the restored-blocks counter says so) and the text equals the engine's without a tier;
after the server is stopped and started again on the same folder, the first request with that
prefix loads it from disk and still gives the same text.
"""

from __future__ import annotations

import random
import time

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.engine.tokenizer import load_tokenizer
from backend.protocol.sampling import SamplingParams
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


def test_a_prompt_evicted_to_disk_is_loaded_not_recomputed_in_the_server_that_wrote_it(make_server, tmp_path):
    """The served model, the default cost rule (auto) and the default token budget, one request at a
    time: the pool holds one ~1400-token prompt but not two, so three other prompts evict it to the
    disk tier; asked again, it must come back from disk (its blocks restored, none recomputed) and
    answer within half the time its first computation took. With the whole prompt prefilled in one
    step, the rule once charged a load a whole step of waiting as long as that prefill, and
    recomputed (1.0-1.5x instead of 5-10x on this machine)."""
    from backend.models.smollm2_model import build

    model = str(build())  # made by make setup; a no-op then
    count = load_tokenizer(model)
    words = random.Random(56)
    vocab = "alpha beta gamma delta river stone cloud light paper glass metal music".split()

    def prompt(index: int) -> str:
        return f"Document {index}: " + " ".join(words.choice(vocab) + str(words.randint(0, 99)) for _ in range(460))

    block_size, num_blocks = 16, 120
    parameters = {"model_dir": model, "tokenizer_dir": model, "num_kv_blocks": str(num_blocks),
                  "block_size": str(block_size), "kv_offload_tier": "disk", "kv_offload_dir": str(tmp_path / "tier"),
                  "kv_offload_bytes": str(1 << 30)}
    server = make_server(parameters)
    with StreamingClient(server.grpc_url, "llm") as client:
        def seconds_to_answer(text: str) -> float:
            start = time.perf_counter()
            result = client.generate(text, max_tokens=1, timeout=120)
            assert result.error is None, result.error
            return time.perf_counter() - start

        seconds_to_answer("warm up")
        for trial in range(2):
            asked = prompt(trial)
            num_tokens = len(count(asked)["input_ids"])
            assert num_blocks * block_size // 2 < num_tokens < (num_blocks - 2) * block_size  # one fits, two do not
            computed = seconds_to_answer(asked)
            for filler in range(3):
                seconds_to_answer(prompt(100 + 10 * trial + filler))
            before = read_metrics(server)
            again = seconds_to_answer(asked)
            after = read_metrics(server)
            restored, recomputed = (metric(after, name) - metric(before, name) for name in (
                "llm_kv_offload_restored_blocks_total", "llm_kv_offload_recomputed_blocks_total"))
            assert restored == (num_tokens - 1) // block_size and recomputed == 0, (trial, restored, recomputed)
            assert again < 0.5 * computed, f"trial {trial}: {again:.3f} s from disk against {computed:.3f} s computed"
