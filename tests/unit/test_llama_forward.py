"""The paged Llama-family forward against transformers on random checkpoints, and load-time checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend.engine.request import Request
from backend.models.family import ModelFamily
from backend.models.loader import ModelLoadError, load_config, load_model
from backend.models.rope import compute_inv_freq, get_rope_parameters
from backend.protocol.sampling import SamplingParams
from backend.runner.model_runner import ModelRunner
from backend.runner.scheduled import ScheduledRequest as Scheduled
from tests.unit.random_models import LLAMA3_ROPE, MODEL_SPECS, get_random_model, reference_logits

CPU = torch.device("cpu")


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize(("name", "block_size"), [("llama_gqa4", 16), ("qwen2_tied", 8), ("llama3_mha", 7), ("mistral_1kv", 12)])
def test_prompt_logits_match_transformers(name, block_size, prepack):
    """Several prompts of different lengths in ONE flattened batch; every row's logits match.

    With oneDNN-prepacked GEMMs (the CPU default) the fp32 summation order differs from
    transformers' F.linear, which shows as ~1e-4 on logits of magnitude ~10: tolerance 2e-4.
    """
    path, _ = get_random_model(name)
    model, hf_config = load_model(path, torch.float32, CPU, prepack=prepack)
    atol = 2e-4 if prepack else 1e-4
    runner = ModelRunner(model, 80, block_size)
    kv_caches = runner.kv_caches
    prompts = _prompts(hf_config.vocab_size, [1, 2, 17, 64, 130, 200])
    scheduled, next_block = [], 1
    for i, prompt in enumerate(prompts):
        num_blocks = -(-len(prompt) // block_size)
        ids = list(range(next_block, next_block + num_blocks))[::-1]  # any order works
        next_block += num_blocks
        scheduled.append(Scheduled(Request(str(i), prompt, SamplingParams()), len(prompt), 0, ids))
    input_ids, positions, metadata, _, _ = runner.prepare(scheduled)
    logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, prompts)), hf_config.vocab_size)
    start = 0
    for prompt in prompts:
        expected = reference_logits(name, tuple(prompt))
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=atol, rtol=1e-4)
        start += len(prompt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prompt_logits_match_transformers_on_cuda():
    path, hf_model = get_random_model("llama_gqa4")
    cuda = torch.device("cuda")
    model, hf_config = load_model(path, torch.float32, cuda)
    runner = ModelRunner(model, 64, 16)
    prompts = _prompts(hf_config.vocab_size, [1, 33, 200])
    scheduled = [Scheduled(Request(str(i), p, SamplingParams()), len(p), 0, list(range(1 + 16 * i, 17 + 16 * i)))
                 for i, p in enumerate(prompts)]
    logits, rows = runner.execute(scheduled)
    assert rows == [0, 1, 2] and logits.device.type == "cuda"
    with torch.no_grad():
        expected = torch.cat([hf_model(torch.tensor([p])).logits[0, -1:] for p in prompts])
    torch.testing.assert_close(logits.cpu(), expected, atol=2e-3, rtol=1e-3)  # TF32 may be on for CUDA matmuls


def test_bfloat16_load_runs_and_roughly_agrees():
    path, hf_model = get_random_model("llama_gqa4")
    model, hf_config = load_model(path, torch.bfloat16, CPU)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    runner = ModelRunner(model, 8, 16)
    prompt = _prompts(hf_config.vocab_size, [40])[0]
    logits, rows = runner.execute([Scheduled(Request("r", prompt, SamplingParams()), 40, 0, [3, 5, 7])])
    assert rows == [0] and logits.dtype == torch.float32
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(logits[0], expected, dim=0) > 0.99


def test_cpu_load_prepacks_the_gemms_by_default():
    path, _ = get_random_model("qwen2_tied")
    model, _ = load_model(path, torch.float32, CPU)
    assert model.model.layers[0].mlp.down_proj.packed_weight is not None
    assert model.logits_packed is not None  # tied embeddings get their own packed copy
    plain, _ = load_model(path, torch.float32, CPU, prepack=False)
    assert plain.model.layers[0].mlp.down_proj.packed_weight is None and plain.logits_packed is None


def test_fused_weights_are_the_checkpoint_weights():
    path, hf_model = get_random_model("qwen2_tied")
    model, _ = load_model(path, torch.float32, CPU)
    ours, theirs = model.model.layers[1], hf_model.model.layers[1]
    torch.testing.assert_close(
        ours.self_attn.qkv_proj.bias,
        torch.cat([theirs.self_attn.q_proj.bias, theirs.self_attn.k_proj.bias, theirs.self_attn.v_proj.bias]),
        rtol=0, atol=0,
    )
    torch.testing.assert_close(
        ours.mlp.gate_up_proj.weight, torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight]), rtol=0, atol=0
    )
    assert model.lm_head is None  # tied: logits use the embedding matrix


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        LLAMA3_ROPE,
    ],
)
def test_inv_freq_matches_transformers(rope):
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=48, rope_parameters=dict(rope))
    params = get_rope_parameters(config)
    if params["rope_type"] == "default":
        expected = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 48, 2, dtype=torch.float) / 48))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, CPU)
    torch.testing.assert_close(compute_inv_freq(params, 48), expected, rtol=0, atol=0)


def test_unsupported_architecture_is_named(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_unsupported_rope_type_is_named(tmp_path):
    config = MODEL_SPECS["llama_gqa4"][0](
        architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="proportional"):
        load_config(str(tmp_path))


def test_a_sliding_window_is_served_at_any_max_model_len(tmp_path):
    """The attention backends honour the window (tests/unit/test_model_families.py for parity)."""
    MistralConfig(architectures=["MistralForCausalLM"], sliding_window=64, max_position_embeddings=4096).save_pretrained(tmp_path)
    config = load_config(str(tmp_path), max_model_len=128)
    assert {layer.sliding_window for layer in ModelFamily.of(config).layers} == {64}


def test_missing_weights_fail_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = get_random_model("mistral_1kv")
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((Path(path) / name).read_text())
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_no_safetensors_fails_clearly(tmp_path):
    path, _ = get_random_model("mistral_1kv")
    config = json.loads((Path(path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, CPU)
