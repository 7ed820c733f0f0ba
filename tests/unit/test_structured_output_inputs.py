"""Structured-output constraints in sampling_parameters: vLLM's object, the guided_* keys, and every bad
constraint refused at once with the key named (before anything is queued)."""

from __future__ import annotations

import json

import pytest

from backend.protocol.structured_output import JSON_OBJECT_SCHEMA, check_spec, parse_structured_outputs
from tests.unit.test_request_inputs import InputError, parse

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}


def constraint(sampling_parameters: dict):
    return parse(text_input="x", sampling_parameters=json.dumps(sampling_parameters)).sampling_params.structured_outputs


def test_each_kind_of_vllm_structured_outputs_object():
    spec = constraint({"structured_outputs": {"json": PERSON}})
    assert spec.kind == "json" and json.loads(spec.value) == PERSON and spec.any_whitespace
    assert list(json.loads(spec.value)["properties"]) == ["name", "age"]  # the order the output follows
    assert spec.key == "sampling_parameters.structured_outputs.json"
    assert constraint({"structured_outputs": {"json": json.dumps(PERSON)}}).value == spec.value  # as a string too
    regex = constraint({"structured_outputs": {"regex": "[a-z]+"}})
    assert (regex.kind, regex.value) == ("regex", "[a-z]+")
    choice = constraint({"structured_outputs": {"choice": ["yes", "no"]}})
    assert (choice.kind, choice.choices) == ("choice", ("yes", "no"))
    grammar = constraint({"structured_outputs": {"grammar": 'root ::= "a"+'}})
    assert (grammar.kind, grammar.value) == ("grammar", 'root ::= "a"+')
    obj = constraint({"structured_outputs": {"json_object": True}})
    assert (obj.kind, json.loads(obj.value), obj.key) == (
        "json", JSON_OBJECT_SCHEMA, "sampling_parameters.structured_outputs.json_object")
    compact = constraint({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    assert not compact.any_whitespace and compact.cache_key != spec.cache_key
    assert constraint({"structured_outputs": None}) is None
    assert constraint({"structured_outputs": {"json": None}}) is None


def test_the_older_guided_keys():
    assert constraint({"guided_json": PERSON}).value == constraint({"structured_outputs": {"json": PERSON}}).value
    assert constraint({"guided_regex": "[0-9]+"}).kind == "regex"
    assert constraint({"guided_choice": ["a", "b"]}).choices == ("a", "b")
    assert constraint({"guided_grammar": 'root ::= "x"'}).kind == "grammar"
    assert constraint({"guided_regex": "[0-9]+"}).key == "sampling_parameters.guided_regex"
    # The same constraint from either spelling shares one compiled grammar.
    assert constraint({"guided_json": PERSON}).cache_key == constraint({"structured_outputs": {"json": PERSON}}).cache_key


@pytest.mark.parametrize(("sampling_parameters", "expected"), [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}},
     "sampling_parameters.structured_outputs.json: not a valid JSON schema at properties/a/type"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": "zero"}}},
     "sampling_parameters.structured_outputs.json: not a valid JSON schema at minimum"),
    ({"structured_outputs": {"json": "{not json"}},
     "sampling_parameters.structured_outputs.json: not valid JSON"),
    ({"structured_outputs": {"json": [1, 2]}},
     "sampling_parameters.structured_outputs.json: a JSON schema must be an object"),
    ({"structured_outputs": {"regex": "([a-z"}},
     "sampling_parameters.structured_outputs.regex: the regex does not compile"),
    ({"structured_outputs": {"regex": ""}}, "sampling_parameters.structured_outputs.regex: expected a non-empty string"),
    ({"structured_outputs": {"choice": []}}, "sampling_parameters.structured_outputs.choice: expected a non-empty list"),
    ({"structured_outputs": {"choice": ["a", ""]}},
     "sampling_parameters.structured_outputs.choice: every choice must be a non-empty string"),
    ({"structured_outputs": {"choice": "yes"}}, "sampling_parameters.structured_outputs.choice: expected a non-empty list"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}},
     "sampling_parameters.structured_outputs.grammar: the EBNF grammar does not compile"),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}},
     "sampling_parameters.structured_outputs.grammar: the EBNF grammar does not compile"),
    ({"structured_outputs": {"json": PERSON, "regex": "a"}},
     "sampling_parameters.structured_outputs: send exactly one constraint, got json and regex"),
    ({"structured_outputs": {"regex": "a", "json_object": True}},
     "sampling_parameters.structured_outputs: send exactly one constraint, got regex and json_object"),
    ({"structured_outputs": {"regx": "a"}}, "sampling_parameters.structured_outputs.regx: unknown key"),
    ({"structured_outputs": {"json_object": "yes"}},
     "sampling_parameters.structured_outputs.json_object: expected a boolean"),
    ({"structured_outputs": "json"}, "sampling_parameters.structured_outputs: expected an object"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": PERSON},
     "sampling_parameters.guided_json: send one constraint; sampling_parameters.structured_outputs.regex is already one"),
    ({"guided_choice": [1, 2]}, "sampling_parameters.guided_choice: every choice must be a non-empty string"),
    ({"guided_regex": "(unclosed"}, "sampling_parameters.guided_regex: the regex does not compile"),
])
def test_bad_constraints_are_refused_naming_the_key(sampling_parameters, expected):
    with pytest.raises(InputError) as info:
        parse(text_input="x", sampling_parameters=json.dumps(sampling_parameters))
    assert str(info.value).startswith(expected), str(info.value)


def test_the_error_carries_xgrammars_reason_without_its_source_location():
    with pytest.raises(InputError) as info:
        parse(text_input="x", sampling_parameters=json.dumps({"guided_grammar": "root ::= foo"}))
    message = str(info.value)
    assert 'Rule "foo" is not defined' in message and ".cc:" not in message


def test_check_spec_accepts_what_xgrammar_supports():
    for obj in ({"json": PERSON}, {"json": True}, {"json_object": True}, {"regex": r"\d{3}-\d{4}"},
                {"choice": ['say "hi"', "back\\slash", "new\nline", "café ☕"]},
                {"grammar": 'root ::= "(" [0-9]+ ")"'}):
        check_spec(parse_structured_outputs(obj))
