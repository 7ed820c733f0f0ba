"""Greedy parity of the whole engine with transformers' generate(), token for token.

16+ mixed-length prompts (1 to a few hundred tokens) run together through the engine, and again
with prefix-cache hits, with chunked prefill forced by a small token budget, and with preemption
forced by a tiny KV pool; every run must equal transformers exactly. The models: the demo model
(Llama, GQA 4), a Qwen2-style model (qkv bias, tied embeddings, GQA 2, block size 7 that divides
no prompt length) and a multi-head model with llama3 rope scaling and an odd block size.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from backend.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from tests.unit.random_models import get_random_model

NUM_PROMPTS = 16
MAX_MODEL_LEN = 1024


def make_prompts(vocab_size: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """Mixed lengths: a 1-token prompt, short ones, and a few of several hundred tokens."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 16, 17, 31, 48, 64, 100, 129, 160, 200, 257, 300, 333, 420][:NUM_PROMPTS]
    rng.shuffle(lengths)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def max_tokens_for(index: int) -> int:
    return 16 + (index * 5) % 17  # 16..32, different per prompt


@functools.cache
def hf_reference(model_key: str, prompts_key: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    model, eos = _hf_model(model_key)
    outputs = []
    with torch.inference_mode():
        for index, prompt in enumerate(prompts_key):
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens_for(index),
                do_sample=False, eos_token_id=eos, pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@functools.cache
def _hf_model(model_key: str):
    from transformers import AutoModelForCausalLM

    path = model_path(model_key)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, model.config.eos_token_id


_DEMO_DIR = None


def model_path(model_key: str) -> str:
    if model_key == "demo":
        return str(_DEMO_DIR)
    return get_random_model(model_key)[0]


@pytest.fixture(scope="module", autouse=True)
def _demo(demo_model_dir):
    global _DEMO_DIR
    _DEMO_DIR = demo_model_dir


def build_engine(model_key: str, block_size: int = 16, num_kv_blocks: int = 1024,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True, attention: str = "torch") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model_dir=model_path(model_key), tokenizer_dir=str(_DEMO_DIR), dtype="float32",
                          device="cpu", attention_backend=attention, max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=True, default_max_tokens=16),
    )
    return LLMEngine(config)


def run_engine(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=max_tokens_for(i)) for i in range(len(prompts))]
    return [r.output_token_ids for r in engine.generate(prompts, params)]


MODELS = [
    # (model key, block size, vocab for prompts)
    ("demo", 16, 8192),
    ("qwen2_tied", 7, 1024),
    ("llama3_mha", 12, 512),
]
# The torch reference path, and the CPU paged decode kernel (backend/attention/cpu_kernel) that
# attention_backend auto picks on the CPU: both token for token equal to transformers in float32.
ATTENTIONS = pytest.mark.parametrize("attention", ["torch", "cpu"])


@ATTENTIONS
@pytest.mark.parametrize(("model_key", "block_size", "vocab"), MODELS, ids=[m[0] for m in MODELS])
def test_batched_greedy_equals_transformers(model_key, block_size, vocab, attention):
    prompts = make_prompts(vocab, seed=1)
    expected = hf_reference(model_key, tuple(map(tuple, prompts)))
    engine = build_engine(model_key, block_size=block_size, attention=attention)
    assert engine.model_runner.attention_backend.name == attention
    assert run_engine(engine, prompts) == expected


def test_batched_greedy_with_the_fused_cpu_ops_equals_transformers():
    """The fused RMSNorm and SiLU x up (cpu_fused_ops, on by default) keep float32 parity too."""
    prompts = make_prompts(8192, seed=1)
    expected = hf_reference("demo", tuple(map(tuple, prompts)))
    engine = build_engine("demo", attention="cpu")
    assert engine.model_runner.model.model.norm.kernels is not None
    assert run_engine(engine, prompts) == expected


@ATTENTIONS
@pytest.mark.parametrize(("model_key", "block_size", "vocab"), MODELS, ids=[m[0] for m in MODELS])
def test_parity_with_prefix_cache_hits(model_key, block_size, vocab, attention):
    prompts = make_prompts(vocab, seed=2, shared_prefix=3 * block_size + 2)
    expected = hf_reference(model_key, tuple(map(tuple, prompts)))
    engine = build_engine(model_key, block_size=block_size, attention=attention)
    first = run_engine(engine, prompts)
    hits_after_first = engine.stats().prefix_cache_hits
    second = run_engine(engine, prompts)  # now whole prompts (but their last token) are cached
    stats = engine.stats()
    assert hits_after_first > 0  # the shared prefix was reused within the first run already
    assert stats.prefix_cache_hits - hits_after_first >= sum(len(p) - block_size for p in prompts if len(p) > block_size)
    assert first == expected
    assert second == expected


@ATTENTIONS
@pytest.mark.parametrize(("model_key", "block_size", "vocab"), MODELS, ids=[m[0] for m in MODELS])
def test_parity_with_chunked_prefill(model_key, block_size, vocab, attention):
    prompts = make_prompts(vocab, seed=1)
    expected = hf_reference(model_key, tuple(map(tuple, prompts)))
    engine = build_engine(model_key, block_size=block_size, max_num_batched_tokens=48, attention=attention)
    params = [SamplingParams(max_tokens=max_tokens_for(i)) for i in range(len(prompts))]
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(index), prompt_token_ids=prompt, sampling_params=param)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    longest = max(len(p) for p in prompts)
    num_prefill_steps = 0
    while engine.has_unfinished_requests():
        step = engine.step()
        assert step.stats.num_prefill_tokens + step.stats.num_decode_tokens <= 48
        num_prefill_steps += step.stats.num_prefill_tokens > 0
        for output in step.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert num_prefill_steps > -(-longest // 48), "no prompt was chunked"  # the longest alone needs that many


@pytest.mark.parametrize(("model_key", "block_size", "vocab"), MODELS, ids=[m[0] for m in MODELS])
def test_parity_with_preemption(model_key, block_size, vocab):
    prompts = make_prompts(vocab, seed=1)
    expected = hf_reference(model_key, tuple(map(tuple, prompts)))
    longest = max(len(p) for p in prompts) + 40
    num_blocks = 2 * -(-longest // block_size) + 2  # room for about two long requests at once
    engine = build_engine(model_key, block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=False)
    assert run_engine(engine, prompts) == expected
    assert engine.stats().num_preemptions > 0
