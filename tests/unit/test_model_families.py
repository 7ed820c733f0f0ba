"""The families of backend/models/family.py against transformers, token for token, in float32.

Each family is a small random checkpoint written by transformers itself (tests/unit/random_models.py):
Qwen3 (q/k norms, head_dim), Qwen3-MoE (a dense layer among sparse ones), Qwen2-MoE (a shared
expert, top-k not renormalised), Mixtral with a sliding window on every layer, Phi-3 (fused
checkpoint projections, half the head rotated, longrope) and Gemma 3 (sliding and global layers
with two rotary bases, sandwich norms, GELU-tanh, soft-capped logits). Prompts run past the
window; runs repeat with prefix hits, with chunked prefill whose chunks cross the window's edge,
and with preemption, on the torch and the CPU-kernel attention. A mismatch is excused only as a
near-tie: transformers' own top-2 logit gap at that step below 1e-4 (float32 summation order can
flip those); the count is printed. A Llama with yarn rope scaling runs alongside.
"""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch

from backend.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from backend.engine.llm_engine import LLMEngine
from backend.models.family import ModelFamily, ModelLoadError
from backend.models.loader import load_config
from backend.protocol.sampling import SamplingParams
from tests.unit.random_models import build_random_model, get_random_model, make_config

NEAR_TIE = 1e-4
MAX_TOKENS = 20
LENGTHS = (1, 7, 33, 47, 64, 96, 150)  # the windows are 40 and 48 positions
FAMILIES = ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral_window", "phi3_longrope", "gemma3", "llama_yarn"]
_TOKENIZER_DIR = None  # the demo model's tokenizer: random checkpoints have none (only detokenizing uses it)


@pytest.fixture(scope="module", autouse=True)
def _tokenizer(demo_model_dir):
    global _TOKENIZER_DIR
    _TOKENIZER_DIR = str(demo_model_dir)


def prompts_for(model_key: str, shared_prefix: int = 0) -> list[list[int]]:
    vocab = make_config(model_key).vocab_size
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@functools.cache
def hf_reference(model_key: str, shared_prefix: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and its top-2 logit gap at each step, prompt by prompt."""
    _, model = get_random_model(model_key)
    tokens, gaps = [], []
    with torch.inference_mode():
        for prompt in prompts_for(model_key, shared_prefix):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            gaps.append([float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)])
    return tokens, gaps


def engine_for(model_key: str, attention: str = "torch", max_num_batched_tokens: int = 2048,
               num_kv_blocks: int = 512, block_size: int = 16, enable_prefix_caching: bool = True) -> LLMEngine:
    folder = get_random_model(model_key)[0]
    return LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=folder, tokenizer_dir=_TOKENIZER_DIR, dtype="float32", device="cpu",
                          attention_backend=attention, max_model_len=1024),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=True, default_max_tokens=16),
    ))


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, [params] * len(prompts))]


def compare(got: list[list[int]], expected: list[list[int]], gaps: list[list[float]]) -> int:
    """Asserts token parity up to near-ties; returns how many prompts diverged at a near-tie."""
    near_ties = 0
    for index, (ours, theirs, gap) in enumerate(zip(got, expected, gaps, strict=True)):
        if ours == theirs:
            continue
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(theirs))
        assert step < len(gap) and gap[step] < NEAR_TIE, (
            f"prompt {index}: first mismatch at step {step} (ours {ours[step:step + 3]}, transformers "
            f"{theirs[step:step + 3]}), top-2 gap "
            f"{gap[step] if step < len(gap) else 'n/a'}")
        near_ties += 1
    return near_ties


@pytest.mark.parametrize("attention", ["torch", "cpu"])
@pytest.mark.parametrize("model_key", FAMILIES)
def test_batched_greedy_equals_transformers(model_key, attention):
    expected, gaps = hf_reference(model_key)
    engine = engine_for(model_key, attention=attention)
    assert engine.model_runner.attention_backend.name == attention
    sparse = [layer.mlp for layer in engine.model_runner.model.model.layers if hasattr(layer.mlp, "experts_down")]
    if attention == "cpu":  # the experts run in the CPU kernel (float32: oneDNN's copies dropped)
        assert all(block.cpu_experts is not None and block.packed is None for block in sparse)
    else:  # no CPU kernels: the experts run on oneDNN-prepacked weights
        assert all(block.packed is not None and block.cpu_experts is None for block in sparse)
    near_ties = compare(generate(engine, prompts_for(model_key)), expected, gaps)
    print(f"\n{model_key} ({attention}): {len(LENGTHS)} prompts, {near_ties} near-ties")


@pytest.mark.parametrize("model_key", FAMILIES)
def test_parity_with_prefix_hits_and_chunks_across_the_window(model_key):
    """Chunks of 24 tokens: a window of 40 or 48 starts inside an earlier chunk; the second run
    takes whole prompts but their last block from the prefix cache."""
    expected, gaps = hf_reference(model_key, shared_prefix=37)
    prompts = prompts_for(model_key, shared_prefix=37)
    engine = engine_for(model_key, attention="cpu", max_num_batched_tokens=24)
    first = generate(engine, prompts)
    hits = engine.stats().prefix_cache_hits
    second = generate(engine, prompts)
    assert hits > 0 and engine.stats().prefix_cache_hits - hits >= sum(len(p) - 16 for p in prompts if len(p) > 16)
    near_ties = compare(first, expected, gaps) + compare(second, expected, gaps)
    print(f"\n{model_key} chunked + prefix hits: {near_ties} near-ties")


@pytest.mark.parametrize("model_key", ["qwen3_moe", "gemma3"])
def test_parity_with_preemption(model_key):
    expected, gaps = hf_reference(model_key)
    prompts = prompts_for(model_key)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    engine = engine_for(model_key, num_kv_blocks=2 * -(-longest // 16) + 2, enable_prefix_caching=False)
    compare(generate(engine, prompts), expected, gaps)
    assert engine.stats().num_preemptions > 0
    assert engine.kv_cache_manager.num_window_freed == 0  # a global layer reads every block (Gemma 3)


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_a_model_whose_every_layer_slides_holds_only_its_window(attention):
    """Mixtral with a window of 40 on every layer, chunks of 24, blocks of 16: a request holds at
    most (40 + 24 - 2) // 16 + 2 = 5 blocks however long it grows, so a pool of 8 usable blocks
    serves prompts of 150 tokens (+ 20 generated: 11 blocks without the window) and still preempts
    under the batch; the output stays transformers' token for token."""
    expected, gaps = hf_reference("mixtral_window")
    prompts = prompts_for("mixtral_window")
    engine = engine_for("mixtral_window", attention=attention, max_num_batched_tokens=24, num_kv_blocks=9,
                        enable_prefix_caching=False)
    kv = engine.kv_cache_manager
    assert kv.sliding_window == 40 and kv.max_blocks_held(170, 24) == 5 < -(-170 // 16)
    held = []  # after each allocation: the blocks each request holds
    allocate = kv.allocate_slots

    def allocate_and_count(*args, **kwargs):
        blocks = allocate(*args, **kwargs)
        held.extend(sum(not block.is_null for block in table) for table in kv.req_to_blocks.values())
        return blocks

    kv.allocate_slots = allocate_and_count
    got = generate(engine, prompts)
    assert max(held) == 5 and kv.num_window_freed > 0 and engine.stats().num_preemptions > 0
    assert kv.usage == 0.0  # every block came back, null entries never freed
    near_ties = compare(got, expected, gaps)
    print(f"\nmixtral_window ({attention}) in 8 blocks: {kv.num_window_freed} blocks given back by the window, "
          f"{engine.stats().num_preemptions} preemptions, {near_ties} near-ties")


def test_the_family_of_each_checkpoint():
    gemma = ModelFamily.of(make_config("gemma3"))
    assert [layer.sliding_window for layer in gemma.layers] == [48, 48, None, 48]
    assert [layer.rope_key for layer in gemma.layers] == ["local", "local", "global", "local"]
    assert gemma.embed_scale == 128**0.5 and gemma.attention_scale == 24**-0.5 and not gemma.plain
    moe = ModelFamily.of(make_config("qwen3_moe"))
    assert [layer.moe is not None for layer in moe.layers] == [True, False, True]
    assert moe.layers[0].moe.top_k == 2 and moe.layers[0].moe.normalize
    shared = ModelFamily.of(make_config("qwen2_moe")).layers[0].moe
    assert shared.shared_intermediate_size == 160 and not shared.normalize
    assert [layer.sliding_window for layer in ModelFamily.of(make_config("mixtral_window")).layers] == [40, 40]
    assert ModelFamily.of(make_config("llama_gqa4")).plain


def test_bf16_and_sharded_checkpoints_load(tmp_path):
    """A bfloat16 checkpoint saved in shards with an index loads and equals transformers reading it."""
    model = build_random_model("qwen3_moe", tmp_path / "bf16", max_shard_size="200KB")
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"), max_shard_size="200KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    prompt = prompts_for("qwen3_moe")[3]
    with torch.inference_mode():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=str(tmp_path / "bf16"), tokenizer_dir=_TOKENIZER_DIR, dtype="float32", device="cpu", max_model_len=256),
        cache=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    ))
    got = engine.generate([prompt], [SamplingParams(max_tokens=8, ignore_eos=True)])[0].output_token_ids
    assert got == want


@pytest.mark.parametrize(("model_key", "overrides", "field"), [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("qwen3", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ("qwen3", {"rope_parameters": {"rope_type": "su", "rope_theta": 10000.0}}, "rope_type 'su'"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
               "max_position_embeddings": 512}, "max_position_embeddings 512"),
])
def test_what_a_family_sets_that_we_do_not_run_is_refused_by_name(tmp_path, model_key, overrides, field):
    """Written into config.json after saving (transformers itself may not build every one of them)."""
    build_random_model(model_key, tmp_path / "m")
    config_file = tmp_path / "m" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **overrides}))
    with pytest.raises(ModelLoadError, match=field):
        load_config(str(tmp_path / "m"), max_model_len=1024)
