"""Structured output in the engine (demo model, no server): constrained tokens, finish reasons, free
neighbours untouched, the compile cache, requests waiting for their grammar, and failures.

The demo model's weights are random, so whatever it writes is the grammar's doing: a regex output
that fully matches, or a JSON output that validates, is the mask at work, not the model.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams
from backend.protocol.structured_output import StructuredOutputError, parse_structured_outputs
from tests.conftest import DEMO_REPOSITORY

PROMPTS = [[1, 10, 20, 30], [1, 7, 8, 9, 11], [1, 40, 41], [1, 300, 301, 302, 303, 304]]
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "ok", "tag", "name", "scores"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))


def constrained(obj: dict, **params) -> SamplingParams:
    params.setdefault("max_tokens", 96)
    return SamplingParams(structured_outputs=parse_structured_outputs(obj), **params)


def test_regex_outputs_match_in_full_and_finish_with_stop(engine):
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    results = engine.generate(PROMPTS, constrained({"regex": pattern}))
    for result in results:
        assert result.finish_reason is FinishReason.STOP, result
        assert re.fullmatch(pattern, result.text), result.text
        assert result.output_token_ids[-1] == engine.eos_token_id  # the grammar ended it by allowing only EOS


def test_choice_outputs_are_one_of_the_choices(engine):
    choices = ["positive", "negative", "neutral", 'say "hi"', "café ☕"]
    results = engine.generate(PROMPTS, constrained({"choice": choices}))
    assert all(r.finish_reason is FinishReason.STOP and r.text in choices for r in results), results


def test_json_schema_outputs_parse_and_validate(engine):
    # Compact JSON: with any whitespace allowed, a random model may write whitespace until max_tokens
    # (the reason vLLM has disable_any_whitespace); the real model's tests use the default.
    results = engine.generate(PROMPTS, constrained({"json": BOUNDED_SCHEMA, "disable_any_whitespace": True},
                                                   max_tokens=200))
    for result in results:
        assert result.finish_reason is FinishReason.STOP, result
        jsonschema.validate(json.loads(result.text), BOUNDED_SCHEMA)


def test_ebnf_grammar_outputs_follow_it(engine):
    grammar = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    for result in engine.generate(PROMPTS, constrained({"grammar": grammar})):
        assert result.finish_reason is FinishReason.STOP and re.fullmatch(r"\([1-9][0-9]{0,2}(,[1-9][0-9]{0,2}){0,3}\)",
                                                                           result.text), result.text


def test_free_requests_get_exactly_their_tokens_alone_in_a_mixed_batch(engine):
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = [r.output_token_ids for r in engine.generate(PROMPTS, free)]
    mixed = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[2]],
        [free, constrained({"json": BOUNDED_SCHEMA}), free, constrained({"regex": "[0-9]{5}"}), free, free],
    )
    assert [mixed[0].output_token_ids, mixed[2].output_token_ids, mixed[4].output_token_ids,
            mixed[5].output_token_ids] == [alone[0], alone[2], alone[0], alone[2]]
    assert re.fullmatch("[0-9]{5}", mixed[3].text)
    # And the constrained ones are the same as when they run alone (greedy).
    assert engine.generate([PROMPTS[3]], [constrained({"regex": "[0-9]{5}"})])[0].text == mixed[3].text


def test_a_repeated_constraint_compiles_once(engine):
    compiler = engine.structured_output.compiler
    schema = dict(BOUNDED_SCHEMA, title="compiled once")  # a constraint no other test sent
    compiles, hits = compiler.num_compiles, compiler.num_cache_hits
    engine.generate(PROMPTS * 2, constrained({"json": schema}))
    assert (compiler.num_compiles - compiles, compiler.num_cache_hits - hits) == (1, 7)
    engine.generate(PROMPTS[:1], constrained({"json": schema}))
    assert compiler.num_compiles - compiles == 1
    assert all(seconds > 0 for seconds in compiler.take_compile_seconds())


def test_a_request_waits_in_the_queue_for_its_grammar_while_others_run(engine, monkeypatch):
    compiler = engine.structured_output.compiler
    real = compiler.compile(parse_structured_outputs({"regex": "[a-c]{4}"}))
    gate: Future = Future()
    monkeypatch.setattr(compiler, "compile", lambda spec: gate)
    engine.add_request("waits", prompt_token_ids=PROMPTS[0], sampling_params=constrained({"regex": "[a-c]{4}"}))
    engine.add_request("runs", prompt_token_ids=PROMPTS[1], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    seen: dict[str, list] = {"waits": [], "runs": []}
    for _ in range(3):
        for output in engine.step().outputs:
            seen[output.request_id].append(output)
    assert [o.finished for o in seen["runs"]] == [False, False, True] and seen["waits"] == []
    assert engine.num_waiting == 1
    gate.set_result(real.result())
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            seen[output.request_id].append(output)
    assert seen["waits"][-1].finish_reason is FinishReason.STOP
    assert re.fullmatch("[a-c]{4}", "".join(o.text for o in seen["waits"]))


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(engine, monkeypatch):
    failed: Future = Future()
    failed.set_exception(StructuredOutputError("sampling_parameters.guided_regex: does not compile: planted"))
    monkeypatch.setattr(engine.structured_output.compiler, "compile", lambda spec: failed)
    engine.add_request("bad", prompt_token_ids=PROMPTS[0], sampling_params=constrained({"regex": "x"}))
    engine.add_request("good", prompt_token_ids=PROMPTS[1], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            outputs.setdefault(output.request_id, []).append(output)
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR
    assert outputs["bad"][-1].error == "sampling_parameters.guided_regex: does not compile: planted"
    assert outputs["good"][-1].finish_reason is FinishReason.LENGTH and outputs["good"][-1].num_output_tokens == 2
    assert not engine.structured_output.has_pending


def test_the_grammar_ends_the_request_even_with_min_tokens_or_ignore_eos(engine):
    for params in (constrained({"choice": ["ab", "cd"]}, min_tokens=10), constrained({"choice": ["ab", "cd"]}, ignore_eos=True)):
        result = engine.generate(PROMPTS[:2], params)
        assert all(r.finish_reason is FinishReason.STOP and r.text in ("ab", "cd") for r in result), result


def test_seeded_constrained_sampling_is_reproducible_and_still_constrained(engine):
    params = constrained({"regex": "[a-z]{2,6}( [a-z]{2,6}){1,3}"}, temperature=1.0, seed=1234)
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS[::-1], params)[::-1]
    assert [r.output_token_ids for r in first] == [r.output_token_ids for r in second]
    assert all(re.fullmatch("[a-z]{2,6}( [a-z]{2,6}){1,3}", r.text) for r in first), [r.text for r in first]


def test_a_stop_string_still_ends_a_constrained_request(engine):
    result = engine.generate(PROMPTS[:1], constrained({"regex": "abc(d|e)fgh"}, stop=["fg"]))[0]
    assert result.finish_reason is FinishReason.STOP and result.text in ("abcd", "abce"), result


def test_preemption_keeps_constrained_outputs(demo_model_dir):
    """A pool too small for every request at once: preempted requests recompute and continue their grammar."""
    roomy = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))
    tight = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), num_kv_blocks="24", block_size="4"))
    params = constrained({"json": BOUNDED_SCHEMA, "disable_any_whitespace": True}, max_tokens=60)
    prompts = [p * 3 for p in PROMPTS] * 2
    expected = [r.output_token_ids for r in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in got] == expected


def test_aborting_a_request_that_waits_for_its_grammar_forgets_it(engine, monkeypatch):
    gate: Future = Future()
    monkeypatch.setattr(engine.structured_output.compiler, "compile", lambda spec: gate)
    engine.add_request("aborted", prompt_token_ids=PROMPTS[0], sampling_params=constrained({"regex": "[a-c]{4}"}))
    assert engine.structured_output.has_pending and not engine.step().outputs
    final = engine.abort_request("aborted")
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert not engine.structured_output.has_pending and not engine.has_unfinished_requests()
    gate.set_result(None)  # a compile finishing after the abort touches nothing
    assert engine.step().outputs == []
