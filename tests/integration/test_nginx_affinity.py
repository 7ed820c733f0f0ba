"""deploy/nginx.conf in front of two real tritonservers on loopback, without Docker.

The compose `scale` profile's routing, checked here with the same file (deploy/local_nginx.py
swaps in loopback upstreams): every session id reaches one replica, whose prefix-cache counters
show the session's hits; a replica going down costs its sessions at most one failed request before
they land on the other one, with no hang; and token streaming passes through the proxy. Which
replica served a request is read from the replicas' own /metrics counters, before and after.
"""

from __future__ import annotations

import time

import pytest

from backend.server.launcher import free_port
from client.generate import main as generate_main
from client.routing import SESSION_HEADER, prefix_routing_key, routing_headers
from client.stream import StreamingClient
from deploy.local_nginx import NginxUnavailable, find_nginx, start_nginx
from deploy.replica_metrics import PREFIX_HITS, SUCCESS, read_counters

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The hash ring depends on the replicas' (random) ports: with 6 sessions all landed on one replica
# about 1 run in 30; with 12, about 1 in 2,000.
SESSIONS = [f"session-{i}" for i in range(12)]
SHARED_TEXT = ("Once upon a time in a quiet harbour town, the lighthouse keeper wrote down every ship "
               "that passed, the colour of its sails, the weather, and the songs the sailors sang. ")
REQUEST_TIMEOUT_S = 30.0  # a request through the proxy must end (answer or error) well before this


@pytest.fixture(scope="module")
def nginx_binary() -> str:
    try:
        return find_nginx(install=True)
    except NginxUnavailable as exc:
        pytest.skip(f"nginx unavailable: {exc}")


@pytest.fixture()
def cluster(make_server, nginx_binary):
    """Two replicas (started together, 2 cores) and nginx on deploy/nginx.conf in front of them."""
    overrides = {"num_kv_blocks": "256", "max_num_seqs": "8", "default_max_tokens": "8"}
    replicas = [make_server(overrides, wait=False) for _ in range(2)]
    for replica in replicas:
        replica.wait_ready(300)
    proxy = start_nginx(free_port(), [r.grpc_port for r in replicas], nginx_binary=nginx_binary)
    try:
        yield proxy, replicas
    finally:
        proxy.stop()


def prompt_for(session: str, turn: int) -> str:
    """A session's prompts share a long first part (its conversation so far), then differ."""
    return f"[{session}] " + SHARED_TEXT * 2 + f"Turn {turn}: what came next?"


def send(proxy, session: str, prompt: str, max_tokens: int = 4):
    """One request on a fresh stream carrying the session header (as client.generate does)."""
    client = StreamingClient(proxy.url, headers=routing_headers(prompt, session_id=session))
    try:
        return client.generate(prompt, timeout=REQUEST_TIMEOUT_S, max_tokens=max_tokens,
                               ignore_eos=True, stream=True)
    finally:
        client.close(cancel_requests=True)


def served_by(replicas, before: list[dict], down: frozenset[int] = frozenset(),
              timeout: float = 10.0) -> tuple[int, list[dict]]:
    """Index of the one replica whose success counter grew since ``before``, and the new counters
    (replicas in ``down`` are stopped: their counters stay as they were)."""
    deadline = time.monotonic() + timeout
    while True:
        after = [b if i in down else read_counters(r.metrics_url) for i, (r, b) in enumerate(zip(replicas, before, strict=True))]
        grown = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a[SUCCESS] > b[SUCCESS]]
        if grown or time.monotonic() > deadline:
            assert len(grown) == 1, f"expected exactly one replica to serve the request, got {grown}"
            return grown[0], after
        time.sleep(0.1)


def test_routing_key_is_stable_and_prefers_the_session_id():
    first_block = "x" * 256
    assert prefix_routing_key(first_block + "tail one") == prefix_routing_key(first_block + "tail two")
    assert prefix_routing_key("a" + first_block) != prefix_routing_key("b" + first_block)
    assert prefix_routing_key("hello") == "p-2cf24dba5fb0a30e"  # sha256: same on every machine
    assert routing_headers("any prompt", session_id="s1") == {SESSION_HEADER: "s1"}
    assert routing_headers("any prompt") == {SESSION_HEADER: prefix_routing_key("any prompt")}


def test_sessions_stick_to_one_replica_and_fail_over_once(cluster):
    proxy, replicas = cluster
    counters = [read_counters(r.metrics_url) for r in replicas]
    home: dict[str, int] = {}

    # Streaming through the proxy: several responses, exactly one final, for the first session.
    first = send(proxy, SESSIONS[0], prompt_for(SESSIONS[0], 0), max_tokens=8)
    assert first.error is None, first.error
    assert first.num_final == 1 and len(first.token_ids) == 8 and first.num_responses >= 2
    home[SESSIONS[0]], counters = served_by(replicas, counters)

    # Affinity: each session's turns land on one replica; later turns hit that replica's prefix cache.
    for turn in range(3):
        for session in SESSIONS:
            if turn == 0 and session == SESSIONS[0]:
                continue
            result = send(proxy, session, prompt_for(session, turn))
            assert result.error is None, f"{session} turn {turn}: {result.error}\n{proxy.log_tail()}"
            before = counters
            replica, counters = served_by(replicas, counters)
            assert home.setdefault(session, replica) == replica, f"{session} moved replicas at turn {turn}"
            if turn > 0:
                assert counters[replica][PREFIX_HITS] > before[replica][PREFIX_HITS], \
                    f"{session} turn {turn} found no prefix-cache hit on its replica"
                other = 1 - replica
                assert counters[other][PREFIX_HITS] == before[other][PREFIX_HITS]
    assert set(home.values()) == {0, 1}, f"consistent hashing used one replica only: {home}"

    # The command-line client's --session-id reaches the session's replica through the proxy.
    for session in SESSIONS[:2]:
        argv = [prompt_for(session, 5), "--url", proxy.url, "--session-id", session, "--max-tokens", "2", "--json"]
        assert generate_main(argv) == 0
        replica, counters = served_by(replicas, counters)
        assert replica == home[session]

    # Failover: the replica of SESSIONS[0] goes down while a stream to it is open.
    down = home[SESSIONS[0]]
    survivor = 1 - down
    moved = [s for s in SESSIONS if home[s] == down]
    open_stream = StreamingClient(proxy.url, headers={SESSION_HEADER: SESSIONS[0]})
    try:
        warm = open_stream.generate(prompt_for(SESSIONS[0], 9), timeout=REQUEST_TIMEOUT_S, max_tokens=2)
        assert warm.error is None
        replica, counters = served_by(replicas, counters)
        assert replica == down
        replicas[down].stop(timeout=5)
        failures = 0
        start = time.monotonic()
        try:  # the open stream's next request fails (its replica is gone) but must not hang
            stale = open_stream.generate(prompt_for(SESSIONS[0], 10), timeout=REQUEST_TIMEOUT_S, max_tokens=2)
            failures += stale.error is not None
        except Exception:  # noqa: BLE001 (a broken stream may raise instead of reporting an error)
            failures += 1
        stale_s = time.monotonic() - start
        assert stale_s < REQUEST_TIMEOUT_S
        print(f"failover: the open stream's request {'failed' if failures else 'succeeded'} in {stale_s:.2f} s")
    finally:
        try:
            open_stream.close(cancel_requests=True)
        except Exception:  # noqa: BLE001
            pass
    for session in moved:
        for turn in (11, 12):
            start = time.monotonic()
            result = send(proxy, session, prompt_for(session, turn))
            assert time.monotonic() - start < REQUEST_TIMEOUT_S
            if result.error is not None:
                failures += 1
                continue
            replica, counters = served_by(replicas, counters, frozenset({down}))
            assert replica == survivor
    print(f"failover: {failures} failed request(s); sessions {moved} moved to replica {survivor}")
    assert failures <= 1, f"{failures} failed requests after the replica went down\n{proxy.log_tail()}"
    # Sessions of the surviving replica did not move.
    for session in SESSIONS:
        if home[session] == survivor:
            assert send(proxy, session, prompt_for(session, 13)).error is None
            replica, counters = served_by(replicas, counters, frozenset({down}))
            assert replica == survivor
