"""Speculative decoding: proposers (prompt lookup, a draft model), exact verification inside the
engine's one forward per step, and a controller that speculates only where the cost model predicts
a gain. backend/engine/llm_engine.py wires them in; see ``speculator.py`` for the flow of one step."""
