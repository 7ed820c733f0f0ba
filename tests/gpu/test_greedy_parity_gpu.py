"""End to end on a GPU: the engine with attention_backend=cupy generates exactly the greedy tokens
it generates with attention_backend=torch.

A small demo Llama (GQA 4, head size 64) built locally; prompts that share a prefix (prefix-cache
hits), one longer than a decode partition (the reduce kernel), and a token budget small enough to
chunk the long prompt over several steps (chunked prefill over a cached prefix).
"""

from __future__ import annotations

import pytest
import torch

from backend.config import parse_engine_config
from backend.protocol.sampling import SamplingParams

MAX_TOKENS = 24


def build_small_model(folder) -> str:
    """A 2-layer demo-style model, GQA 4 (also used by the CPU-emulated kernel parity test)."""
    from backend.models.demo_model import DemoModelSpec, build

    spec = DemoModelSpec(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048)
    return str(build(folder, spec))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_small_model(tmp_path_factory.mktemp("demo") / "demo-small")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 1024, (40,), generator=g).tolist()
    return [
        torch.randint(3, 1024, (5,), generator=g).tolist(),
        shared + torch.randint(3, 1024, (7,), generator=g).tolist(),
        shared + torch.randint(3, 1024, (30,), generator=g).tolist(),
        torch.randint(3, 1024, (700,), generator=g).tolist(),  # > one 512-token partition
        [7],
    ]


def greedy(model_dir: str, attention_backend: str, dtype: str) -> list[list[int]]:
    from backend.engine.llm_engine import LLMEngine

    config = parse_engine_config(
        {
            "model_dir": model_dir,
            "device": "cuda",
            "dtype": dtype,
            "attention_backend": attention_backend,
            "num_kv_blocks": "512",
            "block_size": "16",
            "max_num_batched_tokens": "256",  # the 700-token prompt takes three steps
            "max_num_seqs": "8",
        }
    )
    engine = LLMEngine(config)
    assert engine.model_runner.attention_backend.name == attention_backend
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts(), params)
    return [r.output_token_ids for r in results]


def test_greedy_parity_float32(model_dir):
    torch_tokens = greedy(model_dir, "torch", "float32")
    cupy_tokens = greedy(model_dir, "cupy", "float32")
    assert all(len(t) == MAX_TOKENS for t in cupy_tokens)
    assert cupy_tokens == torch_tokens


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_greedy_parity_16_bit(model_dir, dtype, capsys):
    """Both backends round differently in 16 bits; report where they part, require a long prefix."""
    torch_tokens = greedy(model_dir, "torch", dtype)
    cupy_tokens = greedy(model_dir, "cupy", dtype)
    agree = []
    for a, b in zip(torch_tokens, cupy_tokens, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        agree.append(n)
    with capsys.disabled():
        print(
            f"\n[greedy parity {dtype}] tokens identical before the first difference: {agree} of {MAX_TOKENS}"
        )
    assert min(agree) >= 8, agree
