"""Speculative decoding on the real default model, SmolLM2-135M-Instruct in float32 (issue 17).

Chat prompts that ask the model to repeat or edit a passage (what prompt lookup is for): with
prompt lookup and with a draft (the model's first 6 layers), k = 1, 3 and 5, greedy output equals
decoding without speculation, token for token, batched. A difference is excused only as a
near-tie: at the first differing position the reference's own top-2 logprob gap is below 1e-4
(a verification forward of 1 + k rows may round differently from a one-row decode). The copy
prompts must also really be accepted (most proposals), or the test would prove little.
"""

from __future__ import annotations

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from backend.spec_decode.truncated_draft import build as build_truncated_draft

NEAR_TIE = 1e-4
MAX_TOKENS = 48
FOLDER = REPO_ROOT / "model_repository" / "llm"


@pytest.fixture(scope="module")
def real_model_dir():
    from backend.models.smollm2_model import build

    return build()  # made by make setup; a no-op then


@pytest.fixture(scope="module")
def reference(real_model_dir):
    """(engine without speculation, prompts, its greedy results)."""
    llm = LLMEngine(engine_config_from_model_folder(str(FOLDER), dtype="float32"))
    corpus = (REPO_ROOT / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    passages = [corpus[0:700], corpus[3000:3600], corpus[6000:6500]]
    asks = ["Repeat the following text exactly:", "Copy this text word for word:",
            "Rewrite this text, changing 'default' to 'standard':"]
    prompts = [llm.tokenize(llm.render_chat([{"role": "user", "content": f"{a}\n\n{p}"}]), add_special_tokens=False)
               for a, p in zip(asks, passages, strict=True)]
    prompts.append(llm.tokenize("The capital of France is"))
    results = llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts))
    return llm, prompts, results


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(llm: LLMEngine, tokens: list[int]) -> float:
    """The reference's top-2 logprob gap for the token after ``tokens``."""
    llm.add_request("gap", prompt_token_ids=tokens,
                    sampling_params=SamplingParams(max_tokens=1, logprobs=True, top_logprobs=2))
    top = None
    while llm.has_unfinished_requests():
        for output in llm.step().outputs:
            if output.top_logprobs:
                top = output.top_logprobs[0]
    return top[0][1] - top[1][1]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_with_speculation_equals_without_on_smollm2(reference, real_model_dir, method, k):
    plain, prompts, results = reference
    parameters = {"dtype": "float32", "speculative_method": method, "num_speculative_tokens": str(k),
                  "speculative_controller": "off"}
    if method == "draft":
        draft = build_truncated_draft(real_model_dir, 6, REPO_ROOT / "models" / "smollm2-135m-draft6")
        parameters["speculative_model_dir"] = str(draft)
    llm = LLMEngine(engine_config_from_model_folder(str(FOLDER), **parameters))
    got = llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts))
    near_ties = 0
    for want, have in zip(results, got, strict=True):
        index = first_difference(want.output_token_ids, have.output_token_ids)
        if index is None:
            continue
        gap = top2_gap(plain, want.prompt_token_ids + want.output_token_ids[:index])
        assert gap < NEAR_TIE, (method, k, index, gap, want.text, have.text)
        near_ties += 1
    stats = llm.stats()
    print(f"\nSmolLM2 {method} k={k}: {stats.spec_decode_num_accepted_tokens}/{stats.spec_decode_num_draft_tokens} "
          f"accepted, {near_ties} near-ties")
    if method == "ngram":  # the copy prompts really are copied: most proposals accepted
        assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens > 0
    else:
        assert stats.spec_decode_num_draft_tokens > 0
    assert llm.kv_cache_manager.usage == 0.0
