"""What a request constrains its output to: a JSON schema, a regex, a choice or an EBNF grammar.

The constraint arrives in ``sampling_parameters`` as vLLM sends it: the ``structured_outputs``
object (exactly one of ``json``, ``regex``, ``choice``, ``grammar``, or ``json_object: true``, plus
``disable_any_whitespace``), or, from older clients, one of the keys ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. ``parse_structured_outputs`` turns those
into a ``StructuredOutputSpec``; ``check_spec`` proves it compiles before the request is queued
(xgrammar's tokenizer-free grammar conversion, about a millisecond), so a bad constraint is refused
at once with the key named, and only the token-mask compilation (``compiler.py``) runs later, off
the step.

No xgrammar import at module level: ``backend.protocol.sampling`` imports this file, and every door must
import without it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import jsonschema

KINDS = ("json", "regex", "choice", "grammar")
# The keys of vLLM's StructuredOutputsParams we take; the kinds, then options.
STRUCTURED_OUTPUTS_KEYS = (*KINDS, "json_object", "disable_any_whitespace", "disable_fallback")
# Older vLLM clients (and Triton's vLLM backend users) send these at the top of sampling_parameters.
LEGACY_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}
MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 64 * 1024  # sampling_parameters as a whole is bounded by the same size
JSON_OBJECT_SCHEMA = {"type": "object"}  # json_object: any JSON object, as OpenAI's response_format


class StructuredOutputError(ValueError):
    """A constraint is malformed or does not compile; the message starts with the key's name."""


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """One request's constraint. ``value`` is the schema (canonical JSON text), the regex or the
    grammar; ``choices`` the choice list. ``key`` is where the client put it, for error messages."""

    kind: str  # json | regex | choice | grammar
    value: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True  # JSON: any whitespace between tokens (vLLM's default); False: compact
    key: str = "sampling_parameters.structured_outputs"

    @property
    def cache_key(self) -> str:
        """Equal for constraints that compile to the same grammar (the key they came in is not part)."""
        text = json.dumps([self.kind, self.value, list(self.choices), self.any_whitespace], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def ebnf(self) -> str:
        """The choice list as an EBNF grammar (JSON string escapes are EBNF's too; measured)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)


# ----------------------------------------------------------------------------------------- parsing
def parse_structured_outputs(obj, where: str = "sampling_parameters.structured_outputs") -> StructuredOutputSpec | None:
    """vLLM's ``structured_outputs`` object; None when it is null or names no constraint."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise StructuredOutputError(f"{where}: expected an object with one of {', '.join(KINDS)}")
    unknown = sorted(set(obj) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise StructuredOutputError(
            f"{where}.{unknown[0]}: unknown key (known: {', '.join(STRUCTURED_OUTPUTS_KEYS)})")
    for flag in ("json_object", "disable_any_whitespace", "disable_fallback"):
        if obj.get(flag) is not None and not isinstance(obj[flag], bool):
            raise StructuredOutputError(f"{where}.{flag}: expected a boolean, got {obj[flag]!r}")
    given = [kind for kind in KINDS if obj.get(kind) is not None]
    if obj.get("json_object"):
        given.append("json_object")
    if len(given) > 1:
        raise StructuredOutputError(f"{where}: send exactly one constraint, got {' and '.join(given)}")
    if not given:
        return None
    any_whitespace = not obj.get("disable_any_whitespace", False)
    if given[0] == "json_object":
        return _spec("json", JSON_OBJECT_SCHEMA, f"{where}.json_object", any_whitespace)
    kind = given[0]
    return _spec(kind, obj[kind], f"{where}.{kind}", any_whitespace)


def parse_legacy_key(key: str, value, where: str) -> StructuredOutputSpec | None:
    """``guided_json`` and its siblings; None for a null value."""
    if value is None:
        return None
    return _spec(LEGACY_KEYS[key], value, where, True)


def _spec(kind: str, value, where: str, any_whitespace: bool) -> StructuredOutputSpec:
    if kind == "json":
        return StructuredOutputSpec("json", _schema_text(value, where), any_whitespace=any_whitespace, key=where)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise StructuredOutputError(f"{where}: expected a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise StructuredOutputError(f"{where}: at most {MAX_CHOICES} choices, got {len(value)}")
        if not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputError(f"{where}: every choice must be a non-empty string")
        return StructuredOutputSpec("choice", choices=tuple(value), key=where)
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(f"{where}: expected a non-empty string")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise StructuredOutputError(f"{where}: {len(value)} characters; at most {MAX_CONSTRAINT_CHARS}")
    return StructuredOutputSpec(kind, value, key=where)


def _schema_text(value, where: str) -> str:
    """A JSON schema sent as an object (or true) or as a string holding one; canonical text out."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"{where}: not valid JSON ({exc.msg} at position {exc.pos})") from None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise StructuredOutputError(f"{where}: a JSON schema must be an object, got {type(value).__name__}")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # property order kept: it is the output order


# ----------------------------------------------------------------------------------------- checking
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: ")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(exc).strip()).strip()


def to_grammar(spec: StructuredOutputSpec):
    """The spec as an ``xgrammar.Grammar`` (tokenizer-free; raises xgrammar's errors)."""
    import xgrammar  # noqa: PLC0415 (process: xgrammar imports torch, and Triton's stub imports this module)

    if spec.kind == "json":
        return xgrammar.Grammar.from_json_schema(spec.value, any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        return xgrammar.Grammar.from_ebnf(spec.ebnf())
    return xgrammar.Grammar.from_ebnf(spec.value)


def check_spec(spec: StructuredOutputSpec) -> None:
    """Raises StructuredOutputError naming ``spec.key`` unless the constraint is valid and compiles.

    A JSON schema is first checked against its meta-schema (jsonschema), so an invalid schema is
    named as such and not as a schema xgrammar happens not to support.
    """
    if spec.kind == "json":
        _check_meta_schema(spec)
    try:
        to_grammar(spec)
    except ImportError:
        raise StructuredOutputError(f"{spec.key}: structured output needs the xgrammar package") from None
    except Exception as exc:  # xgrammar raises RuntimeError (and ValueError for JSON)
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar"}[spec.kind]
        raise StructuredOutputError(f"{spec.key}: the {what} does not compile: {xgrammar_message(exc)}") from None


def _check_meta_schema(spec: StructuredOutputSpec) -> None:
    schema = json.loads(spec.value)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise StructuredOutputError(f"{spec.key}: not a valid JSON schema at {path}: {exc.message}") from None
