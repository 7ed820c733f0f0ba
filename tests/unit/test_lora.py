"""LoRA adapters in the engine (issue 34), checked token for token against transformers + peft.

Adapters are made by peft itself on the demo model (float32, random non-zero B so every adapter
changes the output): rank 8 on q/v, rank 16 on all seven projections, rank 8 rsLoRA on the MLP,
rank 4 on o/k. Greedy output equals transformers with the same adapter applied by peft (near-tie
rule of the parity tests) for each adapter alone and for a mixed batch of the base model and the
adapters, with chunked prefill and preemption. Two adapters never share a cached block; at most
max_loras adapters run at once and every request completes; bad adapters and bad names fail their
own request only, naming the problem.
"""

from __future__ import annotations

import functools
import json
import random
import shutil

import peft
import pytest
import torch

from backend.config import ConfigError, engine_config_from_model_folder
from backend.engine.input_processor import EngineInputError
from backend.engine.llm_engine import LLMEngine
from backend.lora.registry import LoRAConfigError, read_registry
from backend.models.demo_model import DEMO_REPOSITORY
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from tests.lora_adapters import ADAPTERS, make_adapters

MAX_TOKENS = 10
NEAR_TIE = 1e-3  # a top-2 logit gap this small may flip with summation order (test_real_model_parity.py)
rng = random.Random(34)
PROMPTS = [[rng.randrange(10, 8000) for _ in range(n)] for n in (5, 37, 130)]


@pytest.fixture(scope="module")
def adapters(demo_model_dir, tmp_path_factory) -> str:
    """The adapters' folders and their multi_lora.json; returns the json's path."""
    return str(make_adapters(str(demo_model_dir), tmp_path_factory.mktemp("loras")))


@functools.cache
def reference(model_dir: str, adapters_json: str, adapter: str | None, prompt: tuple[int, ...]):
    """transformers (+ peft) greedy tokens and the top-2 logit gap at each step."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        folder = json.loads(open(adapters_json).read())[adapter]
        folder = folder if isinstance(folder, str) else folder["path"]
        model = peft.PeftModel.from_pretrained(model, f"{adapters_json.rsplit('/', 1)[0]}/{folder}")
    model.eval()
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    gaps = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
    return out.sequences[0, len(prompt):].tolist(), gaps


def engine(adapters_json: str, **overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(
        str(DEMO_REPOSITORY / "llm"), enable_lora="true", lora_adapters=adapters_json, **overrides))


def params(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora_name=adapter)


def assert_parity(demo_model_dir, adapters_json, requests, results) -> int:
    """Token parity up to near-ties; returns how many diverged at a near-tie."""
    near_ties = 0
    for (prompt, adapter), result in zip(requests, results, strict=True):
        expected, gaps = reference(str(demo_model_dir), adapters_json, adapter, tuple(prompt))
        ours = result.output_token_ids
        if ours == expected:
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b)
        assert gaps[step] < NEAR_TIE, (f"{adapter} on a {len(prompt)}-token prompt: first mismatch at step {step}, "
                                       f"ours {ours[step:step + 3]}, peft {expected[step:step + 3]}, gap {gaps[step]}")
        near_ties += 1
    return near_ties


def test_each_adapter_alone_equals_peft_and_differs_from_the_base(demo_model_dir, adapters):
    llm = engine(adapters)
    base = [r.output_token_ids for r in llm.generate(PROMPTS, params(None))]
    for name in ADAPTERS:
        results = llm.generate(PROMPTS, params(name))
        assert_parity(demo_model_dir, adapters, [(p, name) for p in PROMPTS], results)
        assert [r.output_token_ids for r in results] != base, f"{name} changes nothing"
    assert llm.stats().lora_loads == len(ADAPTERS)
    llm.close()


@pytest.mark.parametrize("overrides", [
    {},  # one step for everything
    {"max_num_batched_tokens": "48"},  # chunked prefill
    {"max_num_batched_tokens": "64", "num_kv_blocks": "24"},  # and a pool that forces preemption
], ids=["together", "chunked", "preempted"])
def test_a_mixed_batch_of_the_base_and_adapters_equals_peft(demo_model_dir, adapters, overrides):
    llm = engine(adapters, max_loras="4", **overrides)
    requests = [(prompt, name) for prompt in PROMPTS for name in (None, *ADAPTERS)]
    results = llm.generate([p for p, _ in requests], [params(n) for _, n in requests])
    near_ties = assert_parity(demo_model_dir, adapters, requests, results)
    print(f"\nLoRA mixed batch ({overrides}): {len(requests)} requests, {near_ties} near-ties")
    if "num_kv_blocks" in overrides:
        assert llm.scheduler.num_preemptions > 0
    llm.close()


def test_a_mixed_batch_at_tensor_parallel_size_2_equals_peft(demo_model_dir, adapters):
    """Each rank holds its slice of every adapter (B by rows for q/k/v and gate/up, A by columns for
    o and down) and loads an adapter on its first step that names it."""
    llm = engine(adapters, max_loras="4", max_num_batched_tokens="48", tensor_parallel_size="2")
    try:
        requests = [(prompt, name) for prompt in PROMPTS for name in (None, *ADAPTERS)]
        results = llm.generate([p for p, _ in requests], [params(n) for _, n in requests])
    finally:
        llm.close()
    near_ties = assert_parity(demo_model_dir, adapters, requests, results)
    print(f"\nLoRA mixed batch at tensor_parallel_size 2: {len(requests)} requests, {near_ties} near-ties")


def test_two_adapters_never_share_a_cached_block(adapters):
    llm = engine(adapters)
    prompt = PROMPTS[2]  # 8 full blocks
    tables = {}
    for name in ("qv8", "all16", "qv8", None):
        before = llm.stats().prefix_cache_hits
        request = llm.add_request(f"r-{len(tables)}", prompt_token_ids=prompt, sampling_params=params(name))
        llm.step()  # the prompt's step: its blocks are allocated (and hashed)
        tables[len(tables)] = (name, llm.kv_cache_manager.get_block_ids(request.request_id),
                               llm.stats().prefix_cache_hits - before)
        while llm.has_unfinished_requests():
            llm.step()
    (_, first, hit0), (_, second, hit1), (_, third, hit2), (_, base, hit3) = tables.values()
    assert hit0 == 0 and hit1 == 0 and hit3 == 0  # all16 and the base model do not hit qv8's blocks
    assert set(first[:8]).isdisjoint(second[:8]) and set(first[:8]).isdisjoint(base[:8])
    assert hit2 == 128 and third[:8] == first[:8]  # qv8 again: its own blocks, all 8
    llm.close()


def test_at_most_max_loras_adapters_run_at_once_and_every_request_completes(adapters):
    llm = engine(adapters, max_loras="2", max_cpu_loras="2")
    for index in range(12):
        name = list(ADAPTERS)[index % 4]
        llm.add_request(f"q-{index}", prompt_token_ids=PROMPTS[index % 3], sampling_params=params(name))
    finished, most = set(), 0
    while llm.has_unfinished_requests():
        for output in llm.step().outputs:
            if output.finished:
                assert output.error is None and output.num_output_tokens == MAX_TOKENS
                finished.add(output.request_id)
        running = {r.sampling_params.lora_name for r in llm.scheduler.running}
        most = max(most, len(running))
        assert len(running) <= 2
    assert len(finished) == 12 and most == 2
    # Adapters of live requests are never evicted (all four were, waiting); once they are done, the
    # next load keeps max_cpu_loras (2) in memory, and an evicted adapter is loaded again on use.
    assert llm.stats().lora_loads == 4 and llm.stats().lora_loaded == 4
    llm.generate([PROMPTS[0]], params("ok4"))
    assert llm.stats().lora_loaded == 2 and set(llm.lora.loaded) == {"mlp8rs", "ok4"}
    llm.generate([PROMPTS[0]], params("qv8"))
    assert llm.stats().lora_loads == 5
    llm.close()


def test_bad_names_and_bad_adapters_fail_their_request_only(demo_model_dir, adapters, tmp_path):
    root = tmp_path / "loras"
    shutil.copytree(adapters.rsplit("/", 1)[0], root)
    (root / "corrupt" ).mkdir()
    shutil.copy(root / "qv8" / "adapter_config.json", root / "corrupt" / "adapter_config.json")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    table = json.loads((root / "multi_lora.json").read_text())
    table.update({"corrupt": "corrupt", "too-big": "all16"})
    (root / "multi_lora.json").write_text(json.dumps(table))
    llm = engine(str(root / "multi_lora.json"), max_lora_rank="8")
    for name, message in (("nope", "lora_name: 'nope' is not an adapter of this model"),
                          ("../qv8", "lora_name: '(not an adapter name)' is not an adapter"),
                          ("/etc", "is not an adapter of this model"),
                          ("too-big", "rank 16 exceeds max_lora_rank 8"),
                          ("corrupt", "adapter_model.safetensors does not load")):
        with pytest.raises(EngineInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            llm.add_request(f"bad-{name}", prompt_token_ids=PROMPTS[0], sampling_params=params(name))
    good = llm.generate([PROMPTS[1], PROMPTS[1]], [params("qv8"), params(None)])
    assert all(len(r.output_token_ids) == MAX_TOKENS for r in good)
    assert llm.input_processor.resolve_lora(None, 44) == "ok4"
    with pytest.raises(EngineInputError, match="lora_task_id: 7 is not an adapter of this model"):
        llm.input_processor.resolve_lora(None, 7)
    llm.close()
    plain = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))
    with pytest.raises(EngineInputError, match="this model serves no LoRA adapters"):
        plain.check_sampling_params(params("qv8"))
    plain.close()


@pytest.mark.parametrize(("text", "message"), [
    ("[1]", "must hold a JSON object"),
    ("{", "is not a readable JSON file"),
    ('{"a/b": "x"}', "a name is letters"),
    ('{"a": {"path": "x", "task_id": -1}}', "task_id must be an integer"),
    ('{"a": {"path": "x", "task_id": 3}, "b": {"path": "y", "task_id": 3}}', "task_id 3 is also 'a'"),
])
def test_bad_adapter_tables_are_refused_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "multi_lora.json"
    path.write_text(text)
    with pytest.raises(LoRAConfigError, match=message):
        read_registry(str(path))


def test_a_missing_table_or_a_draft_model_with_adapters_fails_the_model_load(demo_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="lora_adapters.*does not exist"):
        engine(str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="'enable_lora': not with speculative_method draft"):
        engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), enable_lora="true",
                                        speculative_method="draft", speculative_model_dir=str(demo_model_dir))


def test_speculation_under_adapters_keeps_each_adapters_tokens(adapters):
    """Proposals (an oracle in the ngram proposer's place: the adapter's own continuation, every
    third one wrong) are verified by the adapted model: the same greedy tokens as without them."""
    from tests.unit.test_spec_decode_engine import OracleProposer  # noqa: PLC0415

    requests = [(PROMPTS[index], name) for index, name in enumerate((None, "all16", "qv8"))]
    plain = engine(adapters)
    expected = [r.output_token_ids for r in plain.generate([p for p, _ in requests], [params(n) for _, n in requests])]
    plain.close()
    speculating = engine(adapters, speculative_method="ngram", speculative_controller="off")
    speculating.speculator.ngram = OracleProposer({tuple(p): out for (p, _), out in zip(requests, expected, strict=True)})
    results = speculating.generate([p for p, _ in requests], [params(n) for _, n in requests])
    assert [r.output_token_ids for r in results] == expected
    stats = speculating.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    speculating.close()


def test_smollm2_adapters_alone_and_mixed_equal_peft(tmp_path):
    """The real default model (float32): a rank-16 adapter on every projection and a rank-8 one on
    q/v, each alone and mixed with base requests in one batch, against transformers + peft."""
    from backend.models.smollm2_model import build  # noqa: PLC0415

    model_dir = str(build())  # made by make setup; a no-op then
    table = make_adapters(model_dir, tmp_path, names=("qv8", "all16"))
    llm = LLMEngine(engine_config_from_model_folder(
        str(REPO_ROOT / "model_repository" / "llm"), enable_lora="true", lora_adapters=str(table),
        dtype="float32", model_dir=model_dir, tokenizer_dir=model_dir))
    prompts = [[rng.randrange(10, 49000) for _ in range(n)] for n in (9, 70)]
    requests = [(prompt, name) for prompt in prompts for name in (None, "qv8", "all16")]
    results = llm.generate([p for p, _ in requests], [params(n) for _, n in requests])
    near_ties = assert_parity(model_dir, str(table), requests, results)
    assert [r.output_token_ids for r in results[:3]] != [results[0].output_token_ids] * 3  # the adapters change it
    print(f"\nSmolLM2 LoRA: {len(requests)} requests, {near_ties} near-ties")
    llm.close()
