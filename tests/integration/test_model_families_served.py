"""The new families served by a real tritonserver: Gemma 3 (sliding and global layers) and
Qwen3-MoE, random checkpoints written by transformers with the demo tokenizer's vocabulary,
streamed concurrently over gRPC, each stream's ids equal to transformers' greedy output (near-tie
rule of tests/unit/test_model_families.py) for prompts longer than the window, with chunked prefill
and prompt-lookup speculation on; a structured-output request gets text its regex matches.
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest
import torch

from backend.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from client.stream import StreamingClient
from tests.unit.random_models import build_random_model
from tests.unit.test_model_families import NEAR_TIE

pytestmark = pytest.mark.integration

MAX_TOKENS = 16
WORDS = "the window slides over every token while the global layers keep the whole context in view".split()


def prompts() -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(length))
            for i, length in enumerate((3, 12, 40, 70, 110))]


def transformers_greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    gaps = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
    return out.sequences[0, len(prompt_ids):].tolist(), gaps


@pytest.mark.parametrize("model_key", ["gemma3", "qwen3_moe"])
def test_a_family_streams_transformers_tokens_through_tritonserver(make_server, demo_model_dir, tmp_path, model_key):
    folder = tmp_path / model_key
    model = build_random_model(model_key, folder, vocab_size=8192)  # the demo tokenizer's ids
    tokenized = LLMEngine(EngineConfig(  # the prompt ids exactly as the served engine tokenizes them
        model=ModelConfig(model_dir=str(folder), tokenizer_dir=str(demo_model_dir), dtype="float32", device="cpu",
                          max_model_len=512),
        cache=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
    )).generate(prompts(), SamplingParams(max_tokens=1))
    server = make_server({"model_dir": str(folder), "dtype": "float32", "max_model_len": "512",
                          "max_num_batched_tokens": "32", "speculative_method": "ngram"})
    with concurrent.futures.ThreadPoolExecutor(len(prompts())) as pool:  # one stream per request, all at once
        results = list(pool.map(lambda p: _stream(server.grpc_url, p), prompts()))
    near_ties = 0
    for prompt, result, offline in zip(prompts(), results, tokenized, strict=True):
        assert result.error is None and result.num_final == 1, (prompt, result.error)
        expected, gaps = transformers_greedy(model, offline.prompt_token_ids)
        if result.token_ids != expected:
            step = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected, strict=False)) if a != b)
            assert gaps[step] < NEAR_TIE, (prompt, step, result.token_ids, expected, gaps[step])
            near_ties += 1
    assert max(len(o.prompt_token_ids) for o in tokenized) > 2 * 48  # past the sliding window
    with StreamingClient(server.grpc_url) as client:
        shaped = client.generate(prompts()[3], max_tokens=24, stream=True, timeout=300,
                                 sampling_parameters={"structured_outputs": {"regex": "(window|global) [0-9]{2}"}})
    assert shaped.error is None and re.fullmatch("(window|global) [0-9]{2}", shaped.text), shaped.text
    print(f"\n{model_key} served: {len(results)} streams, {near_ties} near-ties")


def _stream(url: str, prompt: str):
    with StreamingClient(url) as client:
        return client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, stream=True, timeout=300)


TOKENIZER_PROMPTS = ["def f(x):\n    return", " ".join(str(i) for i in range(1, 14)),
                     "Grüße aus München — 東京 café 2024", "<s>hello</s> world\n\tindented  twice"]


def test_a_qwen2_folder_is_tokenized_as_transformers_does_and_streams_its_greedy_tokens(make_server, demo_model_dir,
                                                                                    tmp_path):
    """A Qwen2-shaped checkpoint holding the demo tokenizer's files (tokenizer_config naming
    TokenizersBackend): transformers tokenizes it with Qwen2Tokenizer (digits and indentation split
    its own way); the server must too, so its greedy stream equals transformers' from the first token."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "qwen2"
    model = build_random_model("qwen2_tied", folder, vocab_size=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    server = make_server({"model_dir": str(folder), "tokenizer_dir": str(folder), "dtype": "float32",
                          "max_model_len": "512"})
    near_ties = 0
    for prompt in TOKENIZER_PROMPTS:
        result = _stream(server.grpc_url, prompt)
        assert result.error is None and result.num_final == 1, (prompt, result.error)
        expected, gaps = transformers_greedy(model, tokenizer(prompt)["input_ids"])
        if result.token_ids != expected:
            step = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected, strict=False)) if a != b)
            assert gaps[step] < NEAR_TIE, (prompt, step, result.token_ids, expected, gaps[step])
            near_ties += 1
    assert near_ties <= 1
