"""Offline batch inference through Triton: ``python -m client.batch INPUT.jsonl OUTPUT.jsonl`` (OpenAI batch format)."""
