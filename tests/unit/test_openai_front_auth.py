"""The front's API key and per-client stream cap, through its real routes with a stand-in bridge."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from starlette.testclient import TestClient

from openai_front.app import FrontSettings, create_app
from openai_front.auth import ApiKeys
from openai_front.errors import from_triton
from openai_front.triton_bridge import Piece


class SlowBridge:
    """Answers every generation with one token after ``hold`` seconds; records what it was sent."""

    def __init__(self, hold: float = 0.0):
        self.hold = hold
        self.sent: list[dict] = []

    async def generate(self, prompt, messages, sampling, echo=False, logprobs=False, request_id=""):
        self.sent.append(dict(sampling))
        await asyncio.sleep(self.hold)
        yield Piece(0, "ok", 1, 1, "stop")

    async def ready(self):
        return True

    async def lora_adapters(self):
        return ()

    async def max_model_len(self):
        return 2048

    async def close(self):
        pass


BODY = {"model": "llm", "prompt": "hi", "max_tokens": 1}


def client_for(settings: FrontSettings, bridge) -> TestClient:
    return TestClient(create_app(settings, bridge))


def test_the_key_is_required_when_set_and_a_wrong_one_is_refused():
    bridge = SlowBridge()
    with client_for(FrontSettings(api_keys=ApiKeys(["sekret-value"])), bridge) as client:
        assert client.post("/v1/completions", json=BODY).status_code == 401
        wrong = client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sekret-valuX"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert "sekret" not in wrong.text
        good = client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sekret-value"})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "ok"
        assert client.get("/v1/models").status_code == 401
        assert client.get("/health").status_code == 200  # probes need no key
    assert bridge.sent == [{"max_tokens": 1, "user": "key1"}]  # the key's name is the client


def test_named_keys_name_the_client_and_user_cannot_override_it():
    bridge = SlowBridge()
    with client_for(FrontSettings(api_keys=ApiKeys(["team-a=aaa", "team-b=bbb"])), bridge) as client:
        client.post("/v1/completions", json={**BODY, "user": "someone-else"}, headers={"Authorization": "Bearer bbb"})
    assert bridge.sent[0]["user"] == "team-b"


def test_without_keys_the_user_field_is_the_client():
    bridge = SlowBridge()
    with client_for(FrontSettings(), bridge) as client:
        assert client.post("/v1/completions", json={**BODY, "user": "alice"}).status_code == 200
        assert client.post("/v1/completions", json=BODY).status_code == 200
        assert client.post("/v1/completions", json={**BODY, "user": 7}).json()["error"]["param"] == "user"
    assert [s.get("user") for s in bridge.sent] == ["alice", None]


def test_key_check_time_does_not_depend_on_how_much_of_the_key_is_right():
    keys = ApiKeys(["k" * 40])
    almost = "Bearer " + "k" * 39 + "x"
    nothing = "Bearer " + "x" * 40

    def batch_ns(header: str) -> int:
        started = time.perf_counter_ns()
        for _ in range(2000):
            keys.identify(header)
        return time.perf_counter_ns() - started

    for _ in range(2):  # warm up
        batch_ns(almost), batch_ns(nothing)
    # the two alternate, so a load that comes and goes on a shared machine slows both alike
    ratio = statistics.median(batch_ns(almost) / batch_ns(nothing) for _ in range(15))
    assert 0.8 < ratio < 1.25, ratio
    assert keys.identify("Bearer " + "k" * 40) == "key1" and keys.identify(almost) is None
    assert keys.identify(None) is None and keys.identify("Basic kkk") is None


def test_one_client_over_its_cap_gets_429_while_another_is_served():
    bridge = SlowBridge(hold=0.6)
    settings = FrontSettings(max_streams_per_client=1)
    app = create_app(settings, bridge)

    async def run():
        import httpx2 as httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            app.state.bridge = bridge  # ASGITransport runs no lifespan
            first = asyncio.create_task(client.post("/v1/completions", json={**BODY, "user": "alice"}))
            await asyncio.sleep(0.2)
            second = await client.post("/v1/completions", json={**BODY, "user": "alice"})
            other = await client.post("/v1/completions", json={**BODY, "user": "bob"})
            return (await first), second, other

    first, second, other = asyncio.run(run())
    assert first.status_code == 200 and other.status_code == 200
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert "max_streams_per_client=1" in second.json()["error"]["message"]


def test_the_models_per_client_busy_error_is_a_429():
    error = from_triton("server busy for client 'alice': 4 requests in flight or waiting "
                        "(max_requests_per_client=4); retry when one has finished")
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert from_triton("server busy: 9 requests are waiting (max_queue_len=8); retry later").status == 503


@pytest.mark.parametrize("entry", ["", "name="])
def test_an_empty_key_is_refused_at_start(entry):
    with pytest.raises(ValueError, match="empty"):
        ApiKeys([entry])
