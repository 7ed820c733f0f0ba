"""Prefill/decode disaggregation behind the real vllm-router (issue 33).

One prefill and one decode replica of the demo model (backend/server/replicas.py; float32) behind
vllm-router 0.1.17 in ``--vllm-pd-disaggregation`` mode: the router sends each request to the
prefill replica with ``kv_transfer_params: {"do_remote_decode": true}`` and ``max_tokens`` 1, then
to the decode replica with the transfer parameters that answer carried; the decode engine pulls
the prompt's blocks. The prefill replica also answers plain requests whole, so it is the colocated
reference. Checked: the same greedy text as colocated for mixed prompt lengths, streamed and not,
with prefix hits on either side; forged parameters, a wrong token, a token
used twice and a peer not in the list, each refused; a prefill engine killed between the legs (the
decode side recomputes, within a bound) and a decode engine that never pulls (the prefill engine
frees the kept blocks after the timeout).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.models.demo_model import DEMO_REPOSITORY
from backend.server.replicas import Replicas
from tests.integration.conftest import serve_replicas
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PULL_TIMEOUT_S = 2
KEEP_S = 4
OVERRIDES = {"kv_transfer_timeout_seconds": str(KEEP_S), "kv_transfer_pull_timeout_seconds": str(PULL_TIMEOUT_S),
             "max_num_seqs": "16"}
WORDS = ("river stone lantern orchard violet copper meadow harbor thunder pepper velvet candle "
         "signal marble ember falcon willow granite saddle compass").split()
PREFILL, DECODE = 0, 1


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def post(url: str, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def stream_text(url: str, path: str, body: dict) -> str:
    request = urllib.request.Request(f"{url}{path}", json.dumps(dict(body, stream=True)).encode(),
                                     {"content-type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def answer_text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def values(replicas: Replicas, index: int) -> dict[str, float]:
    return read_metrics(SimpleNamespace(metrics_url=f"http://127.0.0.1:{replicas.ports[index].metrics}/metrics"))


def counter(replicas: Replicas, index: int, name: str) -> float:
    return metric(values(replicas, index), name)


@pytest.fixture(scope="module")
def replicas(demo_model_dir):
    cluster = Replicas(policy="round_robin", model_repository=DEMO_REPOSITORY, overrides=OVERRIDES,
                       num_prefill=1, num_decode=1)
    yield from serve_replicas(cluster)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.2)


def test_greedy_text_through_the_pd_router_equals_colocated(replicas):
    colocated = replicas.ports[PREFILL].url  # the prefill replica also serves plain requests whole
    prompts = [text(seed, words) for seed, words in enumerate((3, 12, 40, 120, 300, 700))]
    bodies = [{"model": "llm", "prompt": p, "max_tokens": 12, "ignore_eos": True} for p in prompts]
    paths = ["/v1/completions"] * len(prompts)  # (the demo model has no chat template)
    expected = [answer_text(post(colocated, path, body)[1]) for path, body in zip(paths, bodies, strict=True)]
    pulls_before = counter(replicas, DECODE, "llm_kv_transfer_pulls_total")
    with ThreadPoolExecutor(len(bodies)) as pool:  # a batch of mixed lengths at once
        answers = list(pool.map(lambda pb: post(replicas.url, *pb), zip(paths, bodies, strict=True)))
    assert [status for status, _ in answers] == [200] * len(bodies), answers
    assert [answer_text(body) for _, body in answers] == expected
    assert all(body["usage"]["completion_tokens"] == 12 for _, body in answers)
    # Every prompt of at least one full block (16 tokens) was pulled, none recomputed.
    decode_metrics = values(replicas, DECODE)
    pulled = metric(decode_metrics, "llm_kv_transfer_pulls_total") - pulls_before
    assert pulled >= 5 and metric(decode_metrics, "llm_kv_transfer_fallbacks_total") == 0
    assert metric(decode_metrics, "llm_kv_transfer_received_bytes_total") > 0
    # Streamed through the router, the same text.
    assert stream_text(replicas.url, paths[4], bodies[4]) == expected[4]
    assert stream_text(replicas.url, paths[-1], bodies[-1]) == expected[-1]
    # The pulled blocks are given back on the prefill side.
    wait_until(lambda: metric(values(replicas, PREFILL), "llm_kv_transfer_pinned_blocks") == 0, 5, "pins freed")


def test_prefix_hits_on_either_side_give_the_same_text(replicas):
    shared = text(7, 300)
    bodies = [{"model": "llm", "prompt": f"{shared} {tail}", "max_tokens": 8, "ignore_eos": True}
              for tail in ("one two", "three four five")]
    expected = [answer_text(post(replicas.ports[PREFILL].url, "/v1/completions", b)[1]) for b in bodies]
    hits = [counter(replicas, i, "llm_prefix_cache_hits_total") for i in (PREFILL, DECODE)]
    received = counter(replicas, DECODE, "llm_kv_transfer_received_bytes_total")
    first = post(replicas.url, "/v1/completions", bodies[0])[1]
    received_first = counter(replicas, DECODE, "llm_kv_transfer_received_bytes_total") - received
    second = post(replicas.url, "/v1/completions", bodies[1])[1]
    received_second = counter(replicas, DECODE, "llm_kv_transfer_received_bytes_total") - received - received_first
    assert [answer_text(first), answer_text(second)] == expected
    assert counter(replicas, PREFILL, "llm_prefix_cache_hits_total") > hits[0]  # the prefix was cached there
    assert counter(replicas, DECODE, "llm_prefix_cache_hits_total") > hits[1]  # and on the decode side
    assert 0 <= received_second < received_first  # so the second pull brought only what followed it


def prefill_leg(replicas: Replicas, prompt: str) -> dict:
    """What the router's first leg does: the prefill replica's answer's kv_transfer_params."""
    status, body = post(replicas.ports[PREFILL].url, "/v1/completions",
                        {"model": "llm", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == replicas.ports[PREFILL].transfer
    return params


def decode_leg(replicas: Replicas, prompt: str, params: dict) -> tuple[int, dict]:
    return post(replicas.ports[DECODE].url, "/v1/completions",
                {"model": "llm", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "kv_transfer_params": params})


def test_forged_parameters_wrong_and_reused_tokens_are_refused(replicas):
    prompt = text(21, 150)
    expected = answer_text(post(replicas.ports[PREFILL].url, "/v1/completions",
                                {"model": "llm", "prompt": prompt, "max_tokens": 8, "ignore_eos": True})[1])
    params = prefill_leg(replicas, prompt)
    # A peer not in kv_transfer_peers: refused at the door, naming the field; nothing is contacted.
    for host, port in (("127.0.0.1", replicas.ports[DECODE].grpc), ("169.254.169.254", 80)):
        status, body = decode_leg(replicas, prompt, dict(params, remote_host=host, remote_port=port))
        assert status == 400 and "kv_transfer_params.remote_host" in body["error"]["message"], body
    status, body = decode_leg(replicas, prompt, dict(params, remote_file="/etc/passwd"))
    assert status == 400 and "unknown key 'remote_file'" in body["error"]["message"]
    refused = counter(replicas, PREFILL, "llm_kv_transfer_refused_total")
    fallbacks = counter(replicas, DECODE, "llm_kv_transfer_fallbacks_total")
    # A wrong token: the prefill engine refuses it; the decode engine recomputes: the same text.
    status, body = decode_leg(replicas, prompt, dict(params, transfer_token="A" * 43))
    assert status == 200 and answer_text(body) == expected
    # The right token reads once; the second use is refused and recomputed.
    assert answer_text(decode_leg(replicas, prompt, params)[1]) == expected
    assert answer_text(decode_leg(replicas, text(22, 150), params)[1]) != ""  # (a prompt not cached here)
    wait_until(lambda: counter(replicas, PREFILL, "llm_kv_transfer_refused_total") - refused >= 2, 5, "refusals counted")
    assert counter(replicas, PREFILL, "llm_kv_transfer_refused_total") - refused == 2
    wait_until(lambda: counter(replicas, DECODE, "llm_kv_transfer_fallbacks_total") - fallbacks >= 2, 5, "fallbacks")
    assert counter(replicas, DECODE, "llm_kv_transfer_fallbacks_total") - fallbacks == 2
    # Over Triton's gRPC path the same check names the field (INVALID_ARG for that request only).
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{replicas.ports[DECODE].grpc}")
    forged = json.dumps({"kv_transfer_params": dict(params, remote_port=1)})
    inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES"), grpcclient.InferInput("sampling_parameters", [1, 1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([[forged.encode()]], dtype=np.object_))
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("llm", inputs)
    wait_until(lambda: errors, 30, "the gRPC answer")
    client.stop_stream()
    assert errors[0] is not None and "kv_transfer_params.remote_host: 127.0.0.1:1 is not one of" in str(errors[0])


def test_a_killed_decode_engine_leaves_the_kept_blocks_freed_after_the_timeout(replicas):
    baseline = metric(values(replicas, PREFILL), "llm_kv_cache_usage_ratio")
    expired = counter(replicas, PREFILL, "llm_kv_transfer_expired_total")
    replicas.kill_tritonserver(DECODE)  # the engine that would have pulled
    prefill_leg(replicas, text(31, 400))
    after_prefill = values(replicas, PREFILL)
    assert metric(after_prefill, "llm_kv_transfer_pinned_blocks") > 0
    assert metric(after_prefill, "llm_kv_cache_usage_ratio") > baseline
    start = time.monotonic()
    wait_until(lambda: metric(values(replicas, PREFILL), "llm_kv_transfer_pinned_blocks") == 0, KEEP_S + 10,
               "kept blocks freed")
    assert KEEP_S - 1 <= time.monotonic() - start + 1
    assert metric(values(replicas, PREFILL), "llm_kv_cache_usage_ratio") == baseline
    assert counter(replicas, PREFILL, "llm_kv_transfer_expired_total") == expired + 1
    replicas.wait_replica(DECODE, timeout=180)  # its launcher brings it back


def test_a_prefill_engine_killed_before_the_pull_is_recomputed_within_a_bound(replicas):
    prompt = text(41, 250)
    expected = answer_text(post(replicas.ports[PREFILL].url, "/v1/completions",
                                {"model": "llm", "prompt": prompt, "max_tokens": 8, "ignore_eos": True})[1])
    params = prefill_leg(replicas, prompt)
    fallbacks = counter(replicas, DECODE, "llm_kv_transfer_fallbacks_total")
    replicas.kill_tritonserver(PREFILL)  # its engine core, and the kept blocks with it
    start = time.monotonic()
    status, body = decode_leg(replicas, prompt, params)
    elapsed = time.monotonic() - start
    print(f"decode leg with a dead prefill engine: {elapsed:.2f} s (pull timeout {PULL_TIMEOUT_S} s)")
    assert status == 200 and answer_text(body) == expected
    assert PULL_TIMEOUT_S <= elapsed < PULL_TIMEOUT_S + 10
    assert counter(replicas, DECODE, "llm_kv_transfer_fallbacks_total") == fallbacks + 1
    replicas.wait_replica(PREFILL, timeout=180)  # its launcher brings it back
