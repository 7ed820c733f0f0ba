"""The types that cross a process or door boundary: a request's sampling parameters (validated and
defaulted in one place), the engine-core messages, request outputs and finish reasons, engine
statistics, and the structured-output and KV-transfer parameters a request carries. The Triton
stub, the OpenAI front's shapes and the engine core all speak these. No torch, and nothing from
backend.engine (an import contract in pyproject.toml).
"""
