"""An OpenAI-compatible HTTP API in front of tritonserver's gRPC endpoint (``python -m openai_front``).

A thin, stateless front: every generation is one gRPC stream to the `llm` model, so the same front
serves any tritonserver that holds that model, the NGC image's included. It imports no Triton
Python utilities and no engine code: only tritonclient, FastAPI and uvicorn.
"""
