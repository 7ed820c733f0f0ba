"""The quality evaluation's scoring (perf/quality): perplexity arithmetic, the float32 reference against
the engine's prompt logprobs on a fixed tiny model (the demo model), the item set, accuracy and the
regression rule."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from perf.quality.qa_items import CODE, ITEMS, Item, build_items
from perf.quality.scoring import accuracy, perplexity, reference_logprobs, regressions
from perf.quality_eval import HELDOUT
from tests.conftest import DEMO_REPOSITORY


def test_perplexity_arithmetic():
    assert perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    assert perplexity([math.log(0.25), math.log(1.0)]) == pytest.approx(2.0)  # exp(mean NLL), not mean of ppl
    with pytest.raises(ValueError):
        perplexity([])


def test_the_engine_scores_the_heldout_text_as_transformers_does_on_the_demo_model(demo_model_dir):
    engine = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), max_num_batched_tokens="128"))
    ids = engine.tokenize(HELDOUT.read_text(encoding="utf-8"))[:600]
    result = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    expected = perplexity(reference_logprobs(str(demo_model_dir), ids))
    got = perplexity(result.prompt_logprobs)
    assert len(result.prompt_logprobs) == len(ids) - 1
    assert got == pytest.approx(expected, rel=1e-4)
    assert expected > 1000  # a random model: the text is news to it (a sanity check of the scale)


def test_the_item_set():
    assert build_items() == ITEMS and len(ITEMS) >= 100 and len({item.id for item in ITEMS}) == len(ITEMS)
    assert {item.kind for item in ITEMS} == {"arithmetic", "capitals", "units", "code"}
    for item in ITEMS:
        assert len(set(item.choices)) == 4 and item.answer in item.choices
        if item.kind == "arithmetic":
            question = item.question.removeprefix("What is ").removesuffix("?")
            a, word, b = question.split()
            assert str({"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[word]) == item.answer
    for code, answer, _ in CODE:  # the Python answers are what Python prints
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code)  # noqa: S102 (our own fixed snippets)
        assert printed.getvalue().strip() == answer, code


def test_accuracy_and_the_regression_rule():
    items = [Item("a", "x", "q", ("1", "2", "3", "4"), "1"), Item("b", "y", "q", ("1", "2", "3", "4"), "2")]
    assert accuracy({"a": "1", "b": "3"}, items) == {"all": 50.0, "x": 100.0, "y": 0.0}
    assert accuracy({"a": "1"}, items)["all"] == 50.0  # a missing answer is wrong
    baseline = {"name": "float32", "reference_perplexity": 10.0, "accuracy": {"all": 50.0}}
    assert regressions({"perplexity": 10.04, "accuracy": {"all": 48.5}}, baseline) == []
    found = regressions({"perplexity": 10.06, "accuracy": {"all": 47.0}}, baseline)
    assert len(found) == 2 and "perplexity +0.60%" in found[0] and "accuracy -3.0 points" in found[1]
