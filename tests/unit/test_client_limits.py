"""Client-facing bounds: the priorities a client may claim, and one client's requests in flight."""

from __future__ import annotations

import pytest

from backend.config import ConfigError
from backend.engine_core.admission import AdmissionControl, BusyError
from backend.engine_core.client_cap import ClientCap
from backend.protocol.sampling import SamplingParams
from backend.triton.client_priority import ClientPriorityRange, parse_client_priority_range
from backend.triton.inputs import InputError


def test_default_range_admits_only_the_default_priority():
    default = parse_client_priority_range({})
    default.apply(SamplingParams(priority=0))
    for claimed in (-2**31, -1, 1):
        with pytest.raises(InputError, match=r"priority: .* 0 to 0 \(parameter client_priority_range\)"):
            default.apply(SamplingParams(priority=claimed))


def test_range_refuses_or_clamps_by_name():
    bounded = parse_client_priority_range({"client_priority_range": "-2:5"})
    params = SamplingParams(priority=5)
    bounded.apply(params)
    assert params.priority == 5
    with pytest.raises(InputError, match=r"-3 is outside .* -2 to 5"):
        bounded.apply(SamplingParams(priority=-3))
    clamped = parse_client_priority_range({"client_priority_range": "-2:5", "client_priority_clamp": "true"})
    low, high = SamplingParams(priority=-2**31), SamplingParams(priority=99)
    clamped.apply(low)
    clamped.apply(high)
    assert (low.priority, high.priority) == (-2, 5)


@pytest.mark.parametrize("text", ["a:b", "3:1", "0:2147483648", "1:2:3"])
def test_a_bad_range_is_a_config_error_naming_it(text):
    with pytest.raises(ConfigError, match="client_priority_range"):
        parse_client_priority_range({"client_priority_range": text})


def test_single_value_range_and_bad_clamp():
    assert parse_client_priority_range({"client_priority_range": "1"}) == ClientPriorityRange(1, 1, False)
    with pytest.raises(ConfigError, match="client_priority_clamp"):
        parse_client_priority_range({"client_priority_clamp": "maybe"})


def test_a_client_at_its_cap_is_busy_while_others_are_admitted():
    admission = AdmissionControl(max_queue_len=100, max_requests_per_client=2)
    admission.admit(client="alice", request_id="a1")
    admission.admit(client="alice", request_id="a2")
    with pytest.raises(BusyError, match=r"client 'alice': 2 requests .*max_requests_per_client=2"):
        admission.admit(client="alice", request_id="a3")
    admission.admit(client="bob", request_id="b1")  # another client is still served
    admission.admit(client="", request_id="s1")
    admission.admit(client="", request_id="s2")
    with pytest.raises(BusyError, match="requests that name no user"):
        admission.admit(client="", request_id="s3")
    admission.clients.release("a1")
    admission.admit(client="alice", request_id="a3")  # a finished request gives its seat back
    assert admission.clients.in_flight("alice") == 2


def test_cap_zero_counts_nothing_and_release_is_idempotent():
    cap = ClientCap(0)
    for i in range(1000):
        assert cap.refusal("x") is None
        cap.acquire("x", str(i))
    assert cap.in_flight("x") == 0
    cap = ClientCap(1)
    cap.acquire("x", "r")
    cap.release("r")
    cap.release("r")
    cap.release("unknown")
    assert cap.in_flight("x") == 0 and cap.refusal("x") is None


def test_engine_client_releases_on_the_final_output():
    """Through a real engine client: the final output posted on the outbox frees the seat."""
    from backend.engine_core.engine_client import EngineClient, empty_stats, engine_outputs
    from backend.protocol.messages import AddRequest
    from backend.protocol.outputs import RequestOutput

    class Recording(EngineClient):
        def start(self): ...
        def _queue(self, request): self.queued = request
        def flush(self): ...
        def abort(self, request_id): ...
        def _drain(self, grace_seconds): ...
        def stop(self, timeout=30.0, message=None): ...

    client = Recording(max_queue_len=10, max_requests_per_client=1)
    client.submit(AddRequest("r1", [1, 2], SamplingParams(user="u"), 0.0))
    with pytest.raises(BusyError):
        client.submit(AddRequest("r2", [1, 2], SamplingParams(user="u"), 0.0))
    client._post(engine_outputs([RequestOutput("r1", [3], "x", False, None, 2, 1)], empty_stats()))
    with pytest.raises(BusyError):
        client.submit(AddRequest("r2", [1, 2], SamplingParams(user="u"), 0.0))
    client._post(engine_outputs([RequestOutput("r1", [], "", True, "stop", 2, 1)], empty_stats()))
    client.submit(AddRequest("r2", [1, 2], SamplingParams(user="u"), 0.0))
