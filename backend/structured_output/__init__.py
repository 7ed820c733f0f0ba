"""Structured output: constraining a request's tokens to a JSON schema, regex, choice or grammar (xgrammar)."""

from backend.protocol.structured_output import StructuredOutputError, StructuredOutputSpec, check_spec

__all__ = ["StructuredOutputError", "StructuredOutputSpec", "check_spec"]
