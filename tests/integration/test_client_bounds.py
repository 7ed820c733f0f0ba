"""Client bounds through a real tritonserver: the priorities a client may claim, and one client's
requests in flight (``client_priority_range``, ``client_priority_clamp``, ``max_requests_per_client``)."""

from __future__ import annotations

import threading
import time

import pytest

from client.stream import StreamingClient

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model", ["llm", "llm_iterative"])
def test_a_priority_outside_the_shipped_range_is_refused_by_name(triton_server, model):
    with StreamingClient(triton_server.grpc_url, model) as client:
        jumped = client.generate("hello", timeout=60, max_tokens=4, priority=-2147483648)
        assert jumped.error is not None and "client_priority_range" in jumped.error and "0 to 1" in jumped.error
        assert jumped.num_final == 1 and not jumped.token_ids
        via_json = client.generate("hello", timeout=60, max_tokens=4, sampling_parameters={"priority": 7})
        assert via_json.error is not None and "7 is outside" in via_json.error
        batch = client.generate("hello", timeout=60, max_tokens=4, priority=1)  # client.batch's priority
        assert batch.error is None and len(batch.token_ids) == 4


def test_one_client_over_its_cap_is_busy_while_another_is_served_and_priorities_clamp(make_server):
    server = make_server({"max_requests_per_client": "2", "client_priority_range": "-1:3",
                          "client_priority_clamp": "true", "scheduling_policy": "priority"})
    results: dict[str, object] = {}

    def run(name: str, user: str, tokens: int) -> None:
        with StreamingClient(server.grpc_url) as client:
            results[name] = client.generate(f"{name} prompt", timeout=120, max_tokens=tokens, ignore_eos=True,
                                            stream=True, sampling_parameters={"user": user})

    holders = [threading.Thread(target=run, args=(f"alice{i}", "alice", 300), daemon=True) for i in range(2)]
    for thread in holders:
        thread.start()
    time.sleep(1.5)  # both of alice's requests are in flight
    run("alice_third", "alice", 4)
    started = time.monotonic()
    run("bob", "bob", 4)
    bob_seconds = time.monotonic() - started
    run("anonymous", "", 4)
    third = results["alice_third"]
    assert third.error is not None and "server busy for client 'alice'" in third.error
    assert "max_requests_per_client=2" in third.error and third.num_final == 1
    assert results["bob"].error is None and len(results["bob"].token_ids) == 4
    assert results["anonymous"].error is None
    for thread in holders:
        thread.join(120)
    assert all(results[f"alice{i}"].error is None and len(results[f"alice{i}"].token_ids) == 300 for i in range(2))
    run("alice_again", "alice", 4)  # her seats came back with her final responses
    assert results["alice_again"].error is None
    with StreamingClient(server.grpc_url) as client:
        clamped = client.generate("hello", timeout=60, max_tokens=4, priority=-100)
    assert clamped.error is None and len(clamped.token_ids) == 4
    print(f"\nalice's third request refused while bob was served in {bob_seconds:.2f} s")
