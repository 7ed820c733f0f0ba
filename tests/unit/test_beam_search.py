"""Beam search (``beam_width``, issue 16) equals transformers' ``generate(num_beams=k, do_sample=False)``.

Token for token on the demo model in float32, for k = 2 and 4, several prompts, length penalties
0, 1 and 2 and every ``early_stopping`` value, with an EOS token the beams do reach (so length
penalty and early stopping change the answer) and one they never reach; the best n come back in
order. Beams fork with copy-on-write blocks and free them exactly (KV usage back to 0), also under
preemption by a tiny pool; ``beam_width`` 1 is greedy; bad settings are refused by name.
"""

from __future__ import annotations

import functools

import pytest
import torch

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams, SamplingParamsError
from tests.conftest import DEMO_REPOSITORY

PROMPTS = [[1, 5, 9, 77, 300, 12], [1, *range(200, 237)], [1, 4000, 17]]
MAX_TOKENS = 8


@functools.cache
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(DEMO_REPOSITORY.parent / "demo-llama"), dtype=torch.float32)


@functools.cache
def greedy(prompt: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = hf_model().generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)
    return out[0, len(prompt):].tolist()


def transformers_beams(prompt, k, length_penalty, early_stopping, eos, n) -> list[list[int]]:
    with torch.no_grad():
        out = hf_model().generate(torch.tensor([prompt]), num_beams=k, do_sample=False, max_new_tokens=MAX_TOKENS,
                                  length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                                  pad_token_id=eos, num_return_sequences=n)
    beams = []
    for row in out.tolist():
        generated = row[len(prompt):]
        beams.append(generated[:generated.index(eos) + 1] if eos in generated else generated)  # padding after EOS
    return beams


def engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), dtype="float32", **overrides))


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLMEngine:
    return engine()


def beams_of(llm: LLMEngine, prompt, k, length_penalty=1.0, early_stopping=False, n=2) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, beam_width=k, n=n, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    return [s.output_token_ids for s in llm.generate([prompt], [params])[0].samples]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("prompt_index", range(len(PROMPTS)))
def test_beams_equal_transformers(llm, k, prompt_index):
    prompt = PROMPTS[prompt_index]
    answers = set()
    for eos in (greedy(tuple(prompt))[2], 7999):  # reached by the beams; never reached
        llm.eos_token_id = eos  # what requests added from now on stop at
        for length_penalty in (0.0, 1.0, 2.0):
            for early_stopping in (False, True, "never"):
                ours = beams_of(llm, prompt, k, length_penalty, early_stopping)
                assert ours == transformers_beams(prompt, k, length_penalty, early_stopping, eos, 2), \
                    (eos, length_penalty, early_stopping)
                answers.add(tuple(map(tuple, ours)))
        assert llm.kv_cache_manager.usage == 0.0
    assert len(answers) > 1  # the settings change the answer: the comparison can tell them apart


def test_beam_width_1_is_greedy(llm):
    llm.eos_token_id = 7999
    for prompt in PROMPTS:
        assert beams_of(llm, prompt, 1, n=1) == [greedy(tuple(prompt))]


def test_beams_share_blocks_copy_on_write_and_survive_preemption(demo_model_dir):
    roomy = engine(num_kv_blocks="64")
    roomy.eos_token_id = 7999
    long_prompt = [1, *range(1000, 1090)]  # 91 tokens: 5 full blocks and a partial one
    params = SamplingParams(max_tokens=40, beam_width=4, n=4)
    roomy.add_request("b", prompt_token_ids=long_prompt, sampling_params=params)
    peak_shared = 0
    outputs = []
    while roomy.has_unfinished_requests():
        step = roomy.step()
        outputs.extend(step.outputs)
        peak_shared = max(peak_shared, roomy.kv_cache_manager.block_pool.num_shared_references)
    assert peak_shared >= 3 * 5 and roomy.kv_cache_manager.num_copy_on_write > 0
    assert [o.sequence_index for o in outputs] == [0, 1, 2, 3] and outputs[-1].finished
    assert sum(o.finished for o in outputs) == 1 and roomy.kv_cache_manager.usage == 0.0
    tiny = engine(num_kv_blocks="11")  # 10 blocks: beams are preempted (their rows kept) and recompute
    tiny.eos_token_id = 7999
    result = tiny.generate([long_prompt], [params])[0]
    assert [s.output_token_ids for s in result.samples] == [o.new_token_ids for o in outputs]
    assert tiny.scheduler.num_preemptions > 0 and tiny.kv_cache_manager.usage == 0.0


def test_an_abort_ends_the_search_with_one_output_and_frees_every_block(llm):
    llm.add_request("x", prompt_token_ids=PROMPTS[1], sampling_params=SamplingParams(max_tokens=30, beam_width=3))
    for _ in range(4):
        llm.step()
    output = llm.abort_request("x")
    assert output.finished and output.finish_reason.value == "abort"
    assert llm.abort_request("x") is None and not llm.has_unfinished_requests()
    assert llm.kv_cache_manager.usage == 0.0 and llm.requests == {}


@pytest.mark.parametrize(("settings", "message"), [
    ({"beam_width": 9}, "beam_width must be an integer in [1, 8]"),
    ({"beam_width": 2, "n": 3}, "n/num_return_sequences (3) must be <= beam_width (2)"),
    ({"beam_width": 2, "temperature": 0.7}, "temperature: does not apply to beam search"),
    ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty: does not apply to beam search"),
    ({"beam_width": 2, "stop": ["x"]}, "stop: not supported with beam search"),
    ({"beam_width": 2, "logprobs": True}, "logprobs: not supported with beam search"),
    ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping must be true, false or \"never\""),
    ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty must be a finite number"),
])
def test_bad_beam_settings_are_refused_by_name(settings, message):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**settings).validate()
    assert str(info.value).startswith(message), str(info.value)
