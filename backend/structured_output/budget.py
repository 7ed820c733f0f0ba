"""What a constraint may cost before it is compiled: its size, and for a JSON schema its nesting,
properties and patterns (the parameters of ``StructuredOutputConfig``, backend/config.py).

A token-mask compile grows with the schema (every property and every pattern becomes grammar
states matched against the whole vocabulary), and xgrammar cannot stop one once started, so a
constraint over the budget is refused when the request is checked, with the key and the
parameter named, and never reaches the compiler. The walk is iterative and visits only the
keywords whose values are schemas (``enum``, ``const`` and ``default`` hold data, not schemas).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from backend.config import StructuredOutputConfig
from backend.protocol.structured_output import StructuredOutputError, StructuredOutputSpec

# Keywords whose value is one schema, a list of schemas, or a map of name -> schema. ``nests``: the
# schema describes a value inside this one (an object's property, an array's item), one level deeper.
_ONE = {"additionalProperties": True, "items": True, "additionalItems": True, "contains": True,
        "unevaluatedItems": True, "unevaluatedProperties": True, "propertyNames": False, "not": False,
        "if": False, "then": False, "else": False}
_LIST = {"prefixItems": True, "items": True, "anyOf": False, "allOf": False, "oneOf": False}
_MAP = {"properties": True, "patternProperties": True, "dependentSchemas": False, "dependencies": False}
_DEFINITIONS = ("$defs", "definitions")  # schemas referenced from elsewhere: their nesting counts as a root's


@dataclass(frozen=True, slots=True)
class SchemaShape:
    """What the budget counts in a JSON schema."""

    depth: int = 0  # levels of nested objects and arrays: a flat object or array is 1, a string 0
    properties: int = 0  # names under every ``properties`` of the schema
    patterns: tuple[tuple[str, str], ...] = ()  # (where, regex): every ``pattern`` and ``patternProperties`` key


def schema_shape(schema) -> SchemaShape:
    """Counts over the whole schema: the root, ``$defs``/``definitions``, items, anyOf and the rest."""
    depth = properties = 0
    patterns: list[tuple[str, str]] = []
    stack = [(schema, 0, "")]  # (schema, the objects and arrays it is inside, its JSON pointer)
    while stack:
        node, level, where = stack.pop()
        if not isinstance(node, dict):
            continue  # true/false schemas, or a malformed keyword value (the meta-schema check names it)
        depth = max(depth, level)
        if isinstance(node.get("pattern"), str):
            patterns.append((f"{where}/pattern", node["pattern"]))
        for keyword in _DEFINITIONS:
            if isinstance(node.get(keyword), dict):
                stack.extend((sub, 0, f"{where}/{keyword}/{name}") for name, sub in node[keyword].items())
        for keyword, nests in _ONE.items():
            if isinstance(node.get(keyword), dict):
                stack.append((node[keyword], level + nests, f"{where}/{keyword}"))
        for keyword, nests in _LIST.items():
            if isinstance(node.get(keyword), list):
                stack.extend((sub, level + nests, f"{where}/{keyword}/{i}") for i, sub in enumerate(node[keyword]))
        for keyword, nests in _MAP.items():
            mapping = node.get(keyword)
            if not isinstance(mapping, dict):
                continue
            if keyword == "properties":
                properties += len(mapping)
            if keyword == "patternProperties":
                patterns.extend((f"{where}/patternProperties", name) for name in mapping)
            stack.extend((sub, level + nests, f"{where}/{keyword}/{name}") for name, sub in mapping.items())
    return SchemaShape(depth, properties, tuple(patterns))


def check_budget(spec: StructuredOutputSpec, config: StructuredOutputConfig) -> None:
    """Raises StructuredOutputError naming ``spec.key`` and the parameter when the constraint is over budget."""
    text = spec.ebnf() if spec.kind == "choice" else spec.value
    size = len(text.encode("utf-8"))
    if size > config.structured_output_max_schema_bytes:
        _refuse(spec, f"{size} bytes", config.structured_output_max_schema_bytes, "structured_output_max_schema_bytes")
    if spec.kind == "regex":
        _check_pattern_length(spec, "the regex", spec.value, config)
    if spec.kind != "json":
        return
    shape = schema_shape(json.loads(spec.value))
    if shape.depth > config.structured_output_max_depth:
        _refuse(spec, f"objects and arrays nested {shape.depth} deep", config.structured_output_max_depth,
                "structured_output_max_depth")
    if shape.properties > config.structured_output_max_properties:
        _refuse(spec, f"{shape.properties} properties", config.structured_output_max_properties,
                "structured_output_max_properties")
    if len(shape.patterns) > config.structured_output_max_patterns:
        _refuse(spec, f"{len(shape.patterns)} patterns", config.structured_output_max_patterns,
                "structured_output_max_patterns")
    for where, pattern in shape.patterns:
        _check_pattern_length(spec, f"the pattern at {where}", pattern, config)


def _check_pattern_length(spec: StructuredOutputSpec, what: str, pattern: str, config: StructuredOutputConfig) -> None:
    if len(pattern) > config.structured_output_max_pattern_length:
        _refuse(spec, f"{what} has {len(pattern)} characters", config.structured_output_max_pattern_length,
                "structured_output_max_pattern_length")


def _refuse(spec: StructuredOutputSpec, found: str, limit: int, parameter: str):
    raise StructuredOutputError(f"{spec.key}: {found}; at most {limit} (parameter {parameter})")
