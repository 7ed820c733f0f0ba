"""Prefill/decode disaggregation: a prefill engine keeps a finished prompt's KV blocks for a decode
engine to pull (docs/architecture.md, "Disaggregated prefill and decode")."""
