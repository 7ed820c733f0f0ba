"""Replicas behind the real vllm-router (issue 32): it routes by where our KV events say a prefix lives.

Two replicas of the demo model (backend/server/replicas.py: tritonserver + OpenAI front each, `llm`
publishing vLLM-format KV events) behind vllm-router 0.1.17 in its ``kv_aware`` policy. The
router's debug log states each decision (the replica, and how many prompt tokens it believed were
cached there); the replicas' own prefix-cache counters say what really happened. Checked: a
shared prefix goes to the replica holding it and hits there; once that replica evicts it, the
router stops crediting it; a router that starts after the blocks were cached learns them from the
replay socket; a replica whose tritonserver is SIGKILLed is routed around, and once its launcher
has it back, its fresh events attract requests again.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from backend.models.demo_model import DEMO_REPOSITORY
from backend.server.replicas import HEALTH_CHECK_INTERVAL_SECONDS, Replicas
from tests.integration.conftest import serve_replicas
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORDS = ("river stone lantern orchard violet copper meadow harbor thunder pepper velvet candle "
         "signal marble ember falcon willow granite saddle compass").split()
HEALTH_WINDOW_S = 2 * HEALTH_CHECK_INTERVAL_SECONDS + 1  # a failed check, and a margin
EVENT_DELAY_S = 1.0  # a step's events reach the router's index (a first batch after a gap takes a replay)
OVERRIDES = {"num_kv_blocks": "48", "block_size": "16", "max_num_seqs": "8"}  # 47 usable blocks: easy to evict


def prompt(seed: int, words: int = 90) -> str:
    """A text of its own for each seed (distinct from the first word on)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete(base_url: str, text: str, max_tokens: int = 2, timeout: float = 60) -> dict:
    body = json.dumps({"model": "llm", "prompt": text, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def hits(replicas: Replicas, index: int) -> float:
    server = SimpleNamespace(metrics_url=f"http://127.0.0.1:{replicas.ports[index].metrics}/metrics")
    return metric(read_metrics(server), "llm_prefix_cache_hits_total")


class DecisionLog:
    """The router's ``KV prefix decision`` lines, read as they come."""

    PATTERN = re.compile(r'KV prefix decision.*?worker="([^"]+)".*?credited_prefix_tokens=(\d+)')

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.offset = 0

    def skip(self) -> None:
        self.offset = len(self.replicas.log_path(None).read_bytes())

    def new(self, wait: float = 5.0) -> list[tuple[int, int]]:
        """(replica index, credited tokens) of the decisions since the last call."""
        deadline = time.monotonic() + wait
        while True:
            data = self.replicas.log_path(None).read_bytes()
            text = re.sub(r"\x1b\[[0-9;]*m", "", data[self.offset:].decode(errors="replace"))
            found = self.PATTERN.findall(text)
            if found or time.monotonic() > deadline:
                self.offset = len(data)
                urls = [ports.url for ports in self.replicas.ports]
                return [(urls.index(url), int(credited)) for url, credited in found]
            time.sleep(0.1)


def routed(replicas: Replicas, log: DecisionLog, text: str) -> tuple[int, int]:
    complete(replicas.url, text)
    decisions = log.new()
    assert len(decisions) == 1, decisions
    return decisions[0]


@pytest.fixture(scope="module")
def replicas(demo_model_dir):
    cluster = Replicas(2, "kv_aware", model_repository=DEMO_REPOSITORY, overrides=OVERRIDES, router_log_level="debug")
    yield from serve_replicas(cluster)


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(replicas):
    log = DecisionLog(replicas)
    log.skip()
    shared = prompt(1)
    first, credited = routed(replicas, log, shared + " alpha")
    assert credited == 0
    time.sleep(EVENT_DELAY_S)
    before = [hits(replicas, 0), hits(replicas, 1)]
    for suffix in ("beta", "gamma", "delta"):
        index, credited = routed(replicas, log, f"{shared} {suffix}")
        assert index == first and credited >= 64  # the router knows the prefix's full blocks are there
    other = 1 - first
    assert hits(replicas, first) - before[first] >= 3 * 64  # and they were hits where it sent them
    assert hits(replicas, other) == before[other]


def test_an_evicted_prefix_stops_attracting_requests(replicas):
    log = DecisionLog(replicas)
    log.skip()
    shared = prompt(2)
    holder, _ = routed(replicas, log, shared + " one")
    time.sleep(EVENT_DELAY_S)
    index, credited = routed(replicas, log, shared + " two")
    assert index == holder and credited >= 64
    for seed in range(10, 16):  # straight to the holder, past the router: its small pool evicts the prefix
        complete(replicas.ports[holder].url, prompt(seed, words=120))
    time.sleep(EVENT_DELAY_S)
    log.skip()
    _, credited = routed(replicas, log, shared + " three")
    assert credited == 0


def test_a_router_started_late_learns_the_cache_from_the_replay_socket(replicas):
    replicas.router.terminate()
    replicas.router.wait(10)
    shared = prompt(3)
    complete(replicas.ports[1].url, shared + " cached before the router")  # published while nobody listened
    replicas.start_router()
    time.sleep(1.0)
    # The next live batch shows the new subscriber the sequence numbers it missed; it asks the
    # replay socket for them and so learns the prefix published before it existed.
    complete(replicas.ports[1].url, prompt(30) + " anything new")
    time.sleep(EVENT_DELAY_S)
    log = DecisionLog(replicas)
    log.skip()
    index, credited = routed(replicas, log, shared + " after")
    assert (index, credited >= 64) == (1, True)


def test_a_killed_replica_is_routed_around_and_its_fresh_events_attract_once_it_is_back(replicas):
    log = DecisionLog(replicas)
    in_flight: dict = {}

    def long_request() -> None:  # straight to replica 0, running when it is killed
        try:
            in_flight["answer"] = complete(replicas.ports[0].url, prompt(40), max_tokens=400, timeout=60)
        except Exception as exc:  # noqa: BLE001 (what the client sees is the point)
            in_flight["error"] = exc

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    replicas.kill_tritonserver(0)
    killed = time.monotonic()
    outcomes = []  # (seconds after the kill, succeeded)
    for number in range(8):
        try:
            complete(replicas.url, prompt(20 + number) + " while replica 0 is down", timeout=30)
            outcomes.append((time.monotonic() - killed, True))
        except urllib.error.HTTPError:
            outcomes.append((time.monotonic() - killed, False))
            time.sleep(0.5)
    thread.join(60)
    print(f"after the kill: {outcomes}")
    assert "error" in in_flight  # the request the dead replica held ended with an error, not an answer
    assert all(ok for seconds, ok in outcomes if seconds > HEALTH_WINDOW_S)  # routed around within the window
    assert sum(ok for _, ok in outcomes) >= 6
    replicas.wait_replica(0, timeout=180)  # the launcher started it again
    back = time.monotonic() - killed
    decisions = []
    deadline = time.monotonic() + 40  # health checks and the circuit breaker let it back in
    while time.monotonic() < deadline:
        # A prefix only the restarted engine holds each time: a probe the router sends to the other
        # replica caches it there, so the next probe needs a new one.
        shared = prompt(50 + len(decisions))
        complete(replicas.ports[0].url, shared + " on the restarted replica")
        time.sleep(EVENT_DELAY_S)
        log.skip()
        decisions.append(routed(replicas, log, shared + " through the router"))
        if decisions[-1][0] == 0:
            break
    rejoined = time.monotonic() - killed
    print(f"replica 0 healthy again {back:.1f} s after the kill, routed to again after {rejoined:.1f} s")
    index, credited = decisions[-1]
    assert (index, credited >= 64) == (0, True)  # the router follows the restarted engine's events
