"""vLLM's render routes and /tokenize's messages, through the front's real routes with a stand-in bridge."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from openai_front.app import FrontSettings, create_app
from openai_front.auth import ApiKeys
from openai_front.errors import from_triton

# vLLM's GenerateRequest fields, in the order its model_dump() writes them.
GENERATE_REQUEST_FIELDS = ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
                           "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
                           "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
                           "ec_transfer_params"]
CHAT = [{"role": "user", "content": "Hi!"}]
CHAT_IDS = [1, 4093, 198, 17830, 17, 2, 198, 1, 520, 9531, 198]


class RenderBridge:
    """Token ids without a server: a text's are its characters' code points; a chat's are CHAT_IDS."""

    def __init__(self, chat_error: str | None = None):
        self.chat_error = chat_error
        self.tokenized: list[tuple[str, bool]] = []
        self.chats: list[list] = []

    async def tokenize(self, text, add_special_tokens=True):
        self.tokenized.append((text, add_special_tokens))
        return [ord(c) for c in text]

    async def render_chat_ids(self, messages):
        self.chats.append(messages)
        if self.chat_error:
            raise from_triton(self.chat_error)
        return list(CHAT_IDS)

    async def default_max_tokens(self):
        return 128

    async def lora_adapters(self):
        return ()

    async def max_model_len(self):
        return 2048

    async def generate(self, *args, **kwargs):
        raise AssertionError("rendering never generates")
        yield

    async def ready(self):
        return True

    async def close(self):
        pass


def client_for(bridge, settings: FrontSettings | None = None) -> TestClient:
    return TestClient(create_app(settings or FrontSettings(), bridge))


def test_completions_render_answers_one_generate_request_per_prompt():
    bridge = RenderBridge()
    with client_for(bridge) as client:
        answer = client.post("/v1/completions/render", json={"model": "llm", "prompt": ["ab", "xyz"]})
        single = client.post("/v1/completions/render", json={"model": "llm", "prompt": "ab"}).json()
    assert answer.status_code == 200
    first, second = answer.json()
    assert [first["token_ids"], second["token_ids"]] == [[97, 98], [120, 121, 122]]
    assert bridge.tokenized == [("ab", True), ("xyz", True), ("ab", True)]  # as `llm` tokenizes a text prompt
    base = first["request_id"].removesuffix("-0")
    assert base.startswith("cmpl-") and second["request_id"] == f"{base}-1"
    assert len(single) == 1 and single[0]["request_id"].startswith("cmpl-") and "-" not in single[0]["request_id"][5:]
    for entry in (first, second, single[0]):
        assert list(entry) == GENERATE_REQUEST_FIELDS
        assert entry["model"] == "llm" and entry["stream"] is False and entry["priority"] == 0
        assert entry["output_mode"] == "tokens"
        assert all(entry[name] is None for name in ("stream_options", "cache_salt", "kv_transfer_params",
                                                    "token_offsets", "features"))


def test_chat_render_answers_one_object_with_the_rendered_ids():
    bridge = RenderBridge()
    with client_for(bridge) as client:
        answer = client.post("/v1/chat/completions/render", json={"model": "llm", "messages": CHAT})
    assert answer.status_code == 200
    body = answer.json()
    assert isinstance(body, dict) and list(body) == GENERATE_REQUEST_FIELDS
    assert body["token_ids"] == CHAT_IDS and body["request_id"].startswith("chatcmpl-")
    assert bridge.chats == [CHAT] and bridge.tokenized == []
    assert body["sampling_params"] == {"max_tokens": 128}  # the `llm` model's default_max_tokens


def test_sampling_params_carry_the_mapped_fields_in_vllms_names():
    asked = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "n": 2,
             "stop": ["\n\n"], "stop_token_ids": [2], "presence_penalty": 0.1, "frequency_penalty": 0.2,
             "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 1}
    with client_for(RenderBridge()) as client:
        completion = client.post("/v1/completions/render", json={"model": "llm", "prompt": "ab", "logprobs": 2,
                                                                  "priority": 1, "stream": True, **asked}).json()[0]
        chat = client.post("/v1/chat/completions/render", json={
            "model": "llm", "messages": CHAT, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3,
            "stream": True, "stream_options": {"include_usage": True}}).json()
    assert completion["sampling_params"] == {**asked, "logprobs": 2}
    assert completion["priority"] == 1 and completion["stream"] is True and completion["stream_options"] is None
    assert chat["sampling_params"] == {"max_tokens": 9, "logprobs": 3}
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions/render", {"model": "llm", "prompt": "ab", "temperature": "hot"}, "temperature"),
    ("/v1/completions/render", {"model": "llm", "prompt": "ab", "tools": [{"type": "function"}]}, "tools"),
    ("/v1/completions/render", {"model": "llm"}, "prompt"),
    ("/v1/completions/render", {"model": "llm", "prompt": ""}, "prompt"),  # no tokens: vLLM refuses it too
    ("/v1/chat/completions/render", {"model": "llm", "messages": CHAT, "top_k": -5}, "top_k"),
    ("/v1/chat/completions/render", {"model": "llm", "messages": []}, "messages"),
    ("/v1/chat/completions/render", {"model": "llm", "messages": CHAT, "add_generation_prompt": False},
     "add_generation_prompt"),
])
def test_a_bad_field_is_a_400_naming_it(route, body, param):
    with client_for(RenderBridge()) as client:
        answer = client.post(route, json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param and answer.json()["error"]["type"] == "invalid_request_error"


def test_the_tokenizer_models_refusal_of_a_chat_names_messages():
    bridge = RenderBridge(chat_error="messages[0].role: expected one of system, user, assistant, tool, developer")
    with client_for(bridge) as client:
        answer = client.post("/v1/chat/completions/render", json={"model": "llm", "messages": [{"role": "robot"}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert answer.json()["error"]["message"].startswith("messages[0].role")


@pytest.mark.parametrize("route", ["/v1/completions/render", "/v1/chat/completions/render"])
def test_an_unknown_model_is_refused_as_the_other_routes_refuse_it(route):
    body = {"model": "gpt-4", "prompt": "ab", "messages": CHAT}
    body.pop("messages" if "chat" not in route else "prompt")
    with client_for(RenderBridge()) as client:
        answer = client.post(route, json=body)
        plain = client.post(route.removesuffix("/render"), json=body)
    assert answer.status_code == plain.status_code == 400
    assert answer.json()["error"]["code"] == plain.json()["error"]["code"] == "model_not_found"


def test_the_render_routes_need_the_api_key_when_keys_are_set():
    with client_for(RenderBridge(), FrontSettings(api_keys=ApiKeys(["sekret"]))) as client:
        refused = client.post("/v1/completions/render", json={"model": "llm", "prompt": "ab"})
        allowed = client.post("/v1/chat/completions/render", json={"model": "llm", "messages": CHAT},
                              headers={"Authorization": "Bearer sekret"})
    assert refused.status_code == 401 and allowed.status_code == 200


def test_tokenize_renders_messages_with_the_chat_template():
    bridge = RenderBridge()
    with client_for(bridge) as client:
        answer = client.post("/tokenize", json={"model": "llm", "messages": CHAT, "add_generation_prompt": True})
        refusals = {name: client.post("/tokenize", json={"messages": CHAT, **extra}).json()["error"]["param"]
                    for name, extra in (("both", {"prompt": "ab"}), ("special", {"add_special_tokens": True}),
                                        ("no generation prompt", {"add_generation_prompt": False}),
                                        ("continue", {"continue_final_message": True}))}
        empty = client.post("/tokenize", json={"messages": []})
    assert answer.status_code == 200
    assert answer.json() == {"tokens": CHAT_IDS, "count": len(CHAT_IDS), "max_model_len": 2048}
    assert bridge.chats == [CHAT]
    assert refusals == {"both": "prompt", "special": "add_special_tokens", "no generation prompt": "add_generation_prompt",
                        "continue": "continue_final_message"}
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("route", ["/v1/completions/render", "/v1/chat/completions/render"])
def test_the_fields_vllm_router_adds_to_a_body_are_ignored(route):
    """vllm-router 0.1.17's exact render body (measured): its SGLang extras must not make it a 400, or
    the router routes by load alone; its cache_aware policy forwards them to the generating routes."""
    common = {"model": "llm", "max_tokens": 3, "stream": False, "no_stop_trim": False, "ignore_eos": False,
              "skip_special_tokens": True, "return_hidden_states": False}
    if "chat" in route:
        body = {**common, "messages": CHAT, "logprobs": False, "continue_final_message": False,
                "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True}
    else:
        body = {**common, "prompt": "ab", "echo": False}
    with client_for(RenderBridge()) as client:
        answer = client.post(route, json=body)
        changed = client.post(route, json={**body, "no_stop_trim": True})
        generating = client.post(route.removesuffix("/render"), json={**body, "no_stop_trim": True})
    assert answer.status_code == 200, answer.text
    assert changed.status_code == 400  # another value is not the router's, and is refused as before
    assert generating.status_code == 400 and generating.json()["error"]["param"] == "no_stop_trim"
