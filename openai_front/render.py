"""vLLM's render answers: what a request would hand the engine, as vLLM's GenerateRequest, without generating.

vllm-router's ``kv_aware`` policy asks a replica for a request's prompt token ids this way
(``POST /v1/completions/render``: a list, one entry per prompt; ``POST /v1/chat/completions/render``:
one entry) and routes by load alone when the answer has no usable ids. The ids are the ones the
`llm` model computes for the same request (openai_front/triton_bridge.py asks the `tokenizer`
model); the sampling parameters are the request's, in vLLM's names, with the max_tokens `llm`
would use. The fields vLLM fills for multimodal input, reasoning parsers and disaggregated serving
are null, as vLLM leaves them for a text-only request.
"""

from __future__ import annotations

from openai_front.errors import bad_request
from openai_front.protocol import GenerationRequest

# vllm-router 0.1.17 adds these SGLang fields, with these values, to every body it renders and, in
# its cache_aware policy, to the requests it forwards (measured); with these values they change
# nothing here, so the front drops them instead of refusing unknown fields. Any other value is left
# for the usual check to refuse.
ROUTER_ADDED_FIELDS = {"no_stop_trim": False, "return_hidden_states": False, "continue_final_message": False,
                       "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True}


def without_router_fields(body):
    """``body`` without the fields vllm-router adds to render requests (anything else untouched)."""
    if not isinstance(body, dict):
        return body
    return {name: value for name, value in body.items()
            if name not in ROUTER_ADDED_FIELDS or value is not ROUTER_ADDED_FIELDS[name]}


def completion_request_ids(base_id: str, prompts: int) -> list[str]:
    """vLLM's ids for a completion's prompts: the base id for one, ``base-i`` for prompt i of several."""
    return [base_id] if prompts == 1 else [f"{base_id}-{i}" for i in range(prompts)]


def generate_request(request_id: str, token_ids: list[int], parsed: GenerationRequest,
                     default_max_tokens: int | None) -> dict:
    """One prompt's answer, in the shape of vLLM's ``GenerateRequest.model_dump()``.

    ``default_max_tokens``: the `llm` model's, for a request that names none.
    """
    if not token_ids:
        field = "messages" if parsed.chat else "prompt"
        raise bad_request(field, f"{field}: the prompt has no tokens")
    sampling = dict(parsed.sampling)
    priority = sampling.pop("priority", 0)  # request fields in vLLM, not sampling parameters
    kv_transfer_params = sampling.pop("kv_transfer_params", None)
    sampling.pop("lora_name", None)  # the adapter is the request's model (vLLM names it there)
    sampling.setdefault("max_tokens", default_max_tokens)
    return {"request_id": request_id, "token_ids": token_ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": sampling, "model": parsed.model, "reasoning_ended": None,
            "reasoning_parser_kwargs": None, "return_token_ids": None, "output_mode": "tokens",
            "stream": parsed.stream, "stream_options": _stream_options(parsed), "cache_salt": None,
            "priority": priority, "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None}


def _stream_options(parsed: GenerationRequest) -> dict | None:
    """vLLM's StreamOptions as sent (its defaults filled in); null unless streaming."""
    if not parsed.stream or parsed.stream_options is None:
        return None
    return {"include_usage": bool(parsed.stream_options.get("include_usage")),
            "continuous_usage_stats": bool(parsed.stream_options.get("continuous_usage_stats"))}
