"""The replicas command's router flags and its guard against starting a replica twice."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from backend.server.replicas import (
    DEFAULT_ROUTER_TEMPERATURE,
    ReplicaError,
    ReplicaPorts,
    Replicas,
    replica_cpus,
    router_command,
)
from openai_front import triton_bridge
from openai_front.triton_bridge import TritonBridge

PORTS = [ReplicaPorts(1, 2, 3, 4005, 4006, 4007, 4008), ReplicaPorts(11, 12, 13, 4105, 4106, 4107, 4108)]


def test_kv_aware_subscribes_to_every_replica_and_sets_session_affinity():
    command = router_command(PORTS, "kv_aware", 8080, 9000, 32, session_affinity_ttl=120)
    sources = [command[i + 1] for i, arg in enumerate(command) if arg == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:4005=tcp://127.0.0.1:4006", "http://127.0.0.1:4105=tcp://127.0.0.1:4106"]
    assert command[command.index("--kv-event-block-size") + 1] == "32"
    assert command[command.index("--kv-aware-session-affinity-ttl-secs") + 1] == "120"
    assert "--kv-aware-session-affinity-ttl-secs" not in router_command(PORTS, "kv_aware", 8080, 9000, 16)


@pytest.mark.parametrize("policy, ttl, message", [("round_robin", 60, "only with the kv_aware policy"),
                                                  ("kv_aware", 0, "1 to 31536000"),
                                                  ("kv_aware", 31_536_001, "1 to 31536000")])
def test_session_affinity_is_refused_where_the_router_would_refuse_it(policy, ttl, message):
    with pytest.raises(ValueError, match=message):
        router_command(PORTS, policy, 8080, 9000, 16, session_affinity_ttl=ttl)
    with pytest.raises(ValueError, match=message):
        Replicas(2, policy, session_affinity_ttl=ttl)


def test_a_running_replica_is_not_started_again():
    replicas = Replicas(1, "round_robin")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        replicas.processes[0] = sleeper
        with pytest.raises(ReplicaError, match="already running"):
            replicas.start_replica(0)
    finally:
        sleeper.kill()
        sleeper.wait()
        replicas.stop()


class CountingClient:
    """Stands in for tritonclient's aio client: counts get_model_config calls."""

    def __init__(self):
        self.calls = 0

    async def get_model_config(self, model, as_json=False):
        self.calls += 1
        return {"config": {"parameters": {"default_max_tokens": {"string_value": "64"},
                                          "max_model_len": {"string_value": "2048"}}}}


def test_the_front_reads_the_model_config_once_per_ttl(monkeypatch):
    bridge = TritonBridge.__new__(TritonBridge)
    bridge.model, bridge.client = "llm", CountingClient()
    bridge._parameters, bridge._parameters_read_at = {}, float("-inf")
    clock = [100.0]
    monkeypatch.setattr(triton_bridge.time, "monotonic", lambda: clock[0])

    async def read():
        return await bridge.default_max_tokens(), await bridge.max_model_len()

    assert asyncio.run(read()) == (64, 2048)
    assert asyncio.run(read()) == (64, 2048)
    assert bridge.client.calls == 1
    clock[0] += triton_bridge.CONFIG_TTL_SECONDS + 0.1
    asyncio.run(read())
    assert bridge.client.calls == 2


def test_replicas_get_disjoint_cpu_shares_or_one_cpu_each():
    assert replica_cpus(2, [0, 1, 2, 3]) == [{0, 1}, {2, 3}]
    assert replica_cpus(3, [0, 1, 2, 3, 4, 5, 6]) == [{0, 1}, {2, 3}, {4, 5}]
    assert replica_cpus(3, [4, 5]) == [{4}, {5}, {4}]
    assert replica_cpus(1, [0, 1]) == [{0, 1}]


def test_disaggregated_replicas_get_their_roles_and_the_router_its_pd_mode():
    from backend.server.replicas import role_parameters  # noqa: PLC0415

    command = router_command(PORTS, "round_robin", 8080, 9000, 16, roles=["prefill", "decode"])
    assert "--vllm-pd-disaggregation" in command and "--worker-urls" not in command
    assert command[command.index("--prefill") + 1] == "http://127.0.0.1:4005"
    assert command[command.index("--decode") + 1] == "http://127.0.0.1:4105"
    with pytest.raises(ValueError, match="--policy: one of"):
        router_command(PORTS, "kv_aware", 8080, 9000, 16, roles=["prefill", "decode"])
    assert role_parameters("prefill", PORTS[0], PORTS[:1]) == {"kv_role": "prefill",
                                                                "kv_transfer_endpoint": "tcp://127.0.0.1:4008"}
    assert role_parameters("decode", PORTS[1], PORTS) == {"kv_role": "decode",
                                                           "kv_transfer_peers": "127.0.0.1:4008,127.0.0.1:4108"}
    assert role_parameters("both", PORTS[0], []) == {}
    replicas = Replicas(policy="round_robin", num_prefill=2, num_decode=1)
    assert replicas.roles == ["prefill", "prefill", "decode"] and len(replicas.ports) == 3
    from backend.server.replicas import PREFILL_DEFAULTS  # noqa: PLC0415

    assert PREFILL_DEFAULTS == {"max_num_batched_tokens": "2048"}  # a prefill replica takes larger steps
    with pytest.raises(ValueError, match="at least 1 each"):
        Replicas(policy="round_robin", num_prefill=1, num_decode=0)


def test_the_router_temperature_reaches_kv_aware_only():
    command = router_command(PORTS, "kv_aware", 8080, 9000, 16, router_temperature=4)
    assert command[command.index("--router-temperature") + 1] == "4.0"
    default = router_command(PORTS, "kv_aware", 8080, 9000, 16)
    assert default[default.index("--router-temperature") + 1] == repr(DEFAULT_ROUTER_TEMPERATURE)
    deterministic = router_command(PORTS, "kv_aware", 8080, 9000, 16, router_temperature=0)
    assert deterministic[deterministic.index("--router-temperature") + 1] == "0.0"
    assert "--router-temperature" not in router_command(PORTS, "cache_aware", 8080, 9000, 16)
    for policy, temperature, message in (("cache_aware", 1.0, "only with the kv_aware policy"),
                                         ("kv_aware", -0.5, "a finite number >= 0"),
                                         ("kv_aware", float("nan"), "a finite number >= 0")):
        with pytest.raises(ValueError, match=message):
            router_command(PORTS, policy, 8080, 9000, 16, router_temperature=temperature)
        with pytest.raises(ValueError, match=message):
            Replicas(2, policy, router_temperature=temperature)
