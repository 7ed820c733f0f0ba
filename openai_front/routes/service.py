"""``GET /v1/models`` (the model and its LoRA adapters), ``GET /health`` (200 only while Triton's
model is ready) and ``GET /metrics`` (the front's own)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from openai_front.state import bridge_of, front_of

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    front, bridge = front_of(request), bridge_of(request)
    max_len = await bridge.max_model_len()
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "triton-llm-serving", "root": name,
             "max_model_len": max_len} for name in front.served]
    data += [{"id": name, "object": "model", "created": 0, "owned_by": "triton-llm-serving", "root": name,
              "parent": front.settings.model, "max_model_len": max_len} for name in await bridge.lora_adapters()]
    return {"object": "list", "data": data}


@router.get("/health")
async def health(request: Request):
    ready = await bridge_of(request).ready()
    return Response(status_code=200 if ready else 503)


@router.get("/metrics")
async def front_metrics(request: Request):
    return Response(generate_latest(front_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
