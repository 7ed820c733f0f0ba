"""Prefill/decode disaggregation between two engines in one process (issue 33), over real ZMQ/TCP.

A prefill engine computes each prompt and its first token and keeps the prompt's blocks; a decode
engine pulls them and goes on. Greedy output equals one colocated engine's token for token (float32),
for prompts of mixed lengths, with prefix hits on either side. Every way a pull can go wrong leaves
the same answer, computed locally, and is counted; every way a client can misuse the transfer is
refused: a forged peer (nothing contacted), a wrong or reused token, a range outside the request,
malformed messages. Kept blocks come back after a pull, after the timeout, and when the pool needs
them.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from backend.config import ConfigError, engine_config_from_model_folder
from backend.engine.input_processor import EngineInputError
from backend.engine.llm_engine import LLMEngine
from backend.kv_transfer.wire import PullHeader, PullRequest
from backend.models.demo_model import DEMO_REPOSITORY
from backend.protocol.kv_transfer import KVTransferParamsError, parse_kv_transfer_params
from backend.protocol.sampling import SamplingParams

rng = random.Random(33)
PREFIX = [rng.randrange(10, 8000) for _ in range(100)]
PROMPTS = [[rng.randrange(10, 8000) for _ in range(n)] for n in (5, 16, 33, 130, 300)] + [PREFIX + [7, 8, 9]]
MAX_TOKENS = 10


def engine(**overrides: str) -> LLMEngine:
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides))


def greedy(max_tokens: int = MAX_TOKENS, transfer: dict | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                          kv_transfer_params=parse_kv_transfer_params(transfer))


def prefill_all(prefill: LLMEngine, prompts) -> list:
    """The prefill legs (max_tokens 1, do_remote_decode), all at once: their final outputs in order."""
    finals = {}
    for index, prompt in enumerate(prompts):
        prefill.check_sampling_params(greedy(1, {"do_remote_decode": True}))
        prefill.add_request(f"prefill-{index}-{time.monotonic_ns()}", prompt_token_ids=prompt,
                            sampling_params=greedy(1, {"do_remote_decode": True}))
    order = list(prefill.requests)
    while prefill.has_unfinished_requests():
        for output in prefill.step().outputs:
            if output.finished:
                finals[output.request_id] = output
    return [finals[request_id] for request_id in order]


@pytest.fixture(scope="module")
def colocated(demo_model_dir):
    llm = engine()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def expected(colocated) -> list[list[int]]:
    return [r.output_token_ids for r in colocated.generate(PROMPTS, greedy())]


@pytest.fixture
def pair(demo_model_dir):
    prefill = engine(kv_role="prefill", kv_transfer_timeout_seconds="30")
    decode = engine(kv_role="decode", kv_transfer_peers=f"127.0.0.1:{prefill.kv_transfer.port}",
                    kv_transfer_pull_timeout_seconds="2")
    yield prefill, decode
    prefill.close()
    decode.close()


def decode_all(decode: LLMEngine, prompts, finals) -> list[list[int]]:
    params = [greedy(transfer=final.kv_transfer_params) for final in finals]
    return [r.output_token_ids for r in decode.generate(prompts, params)]


def test_disaggregated_greedy_equals_colocated_and_the_kept_blocks_come_back(pair, expected):
    prefill, decode = pair
    finals = prefill_all(prefill, PROMPTS)
    assert [f.new_token_ids for f in finals] == [e[:1] for e in expected]  # the prefill's first token
    full_blocks = [len(p) // 16 for p in PROMPTS]
    assert [len(f.kv_transfer_params["remote_block_ids"]) for f in finals] == full_blocks
    assert prefill.kv_transfer.num_pinned_blocks == sum(full_blocks)
    assert prefill.stats().kv_cache_usage > 0  # kept blocks are in use until pulled
    assert decode_all(decode, PROMPTS, finals) == expected
    pulled = [(len(p) - 1) // 16 for p in PROMPTS]  # the last prompt token is always computed here
    stats = decode.stats()
    assert stats.kv_transfer_pulls == sum(1 for n in pulled if n) and stats.kv_transfer_fallbacks == 0
    assert stats.kv_transfer_received_blocks == sum(pulled)
    assert stats.kv_transfer_received_bytes == prefill.stats().kv_transfer_sent_bytes > 0
    assert len(stats.kv_transfer_pull_seconds) == stats.kv_transfer_pulls
    assert stats.prefix_cache_hits == 0  # everything pulled came through the transfer, not a local hit
    prefill.release_transferred()
    assert prefill.kv_transfer.num_pinned_blocks == 0 and prefill.kv_cache_manager.usage == 0.0
    assert prefill.stats().kv_transfer_served_pulls == len(PROMPTS) and prefill.stats().kv_transfer_refused_pulls == 0


def test_prefix_hits_on_either_side_give_the_same_tokens(pair, colocated):
    prefill, decode = pair
    prompts = [PREFIX + [11, 12], PREFIX + [13] * 40]
    expected = [r.output_token_ids for r in colocated.generate(prompts, greedy())]
    decode.generate([PREFIX + [1, 2, 3]], greedy(2))  # the decode engine has the prefix's 6 blocks cached
    prefill.generate([PREFIX + [4, 5]], greedy(2))  # and so has the prefill engine
    finals = prefill_all(prefill, prompts)
    assert all(f.num_cached_tokens == 96 for f in finals)  # a prefix hit on the prefill side
    before = decode.stats()
    assert decode_all(decode, prompts, finals) == expected
    after = decode.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * 96  # and on the decode side
    # Only the blocks after the local hit were pulled: 0 for the first, (100 + 40 - 1) // 16 - 6 = 2 for the second.
    assert after.kv_transfer_received_blocks - before.kv_transfer_received_blocks == 2
    prefill.release_transferred()
    assert prefill.kv_transfer.num_pinned_blocks == 0  # the first prompt's pin was released without a read


def test_a_prefill_engine_that_never_answers_is_recomputed_after_the_pull_timeout(demo_model_dir, expected):
    context = zmq.Context.instance()
    silent = context.socket(zmq.ROUTER)  # takes the pull and never answers: a prefill engine that died
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    decode = engine(kv_role="decode", kv_transfer_peers=f"127.0.0.1:{port}", kv_transfer_pull_timeout_seconds="1")
    try:
        forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
                  "transfer_token": "x" * 43}
        start = time.monotonic()
        results = decode.generate(PROMPTS[3:5], [greedy(transfer=forged)] * 2)
        elapsed = time.monotonic() - start
        assert [r.output_token_ids for r in results] == expected[3:5]
        assert decode.stats().kv_transfer_fallbacks == 2 and decode.stats().kv_transfer_pulls == 0
        assert 1.0 <= elapsed < 10.0
        assert silent.poll(0)  # the pull did reach it
    finally:
        decode.close()
        silent.close(0)


def test_a_decode_engine_that_never_pulls_leaves_the_blocks_kept_until_the_timeout(demo_model_dir):
    prefill = engine(kv_role="prefill", kv_transfer_timeout_seconds="1")
    try:
        prefill_all(prefill, PROMPTS[3:5])
        assert prefill.kv_transfer.num_pinned_blocks == 130 // 16 + 300 // 16
        prefill.release_transferred()
        assert prefill.kv_transfer.num_pinned_blocks > 0  # not yet
        time.sleep(1.1)
        prefill.release_transferred()
        assert prefill.kv_transfer.num_pinned_blocks == 0 and prefill.kv_cache_manager.usage == 0.0
        assert prefill.stats().kv_transfer_expired_pins == 2
    finally:
        prefill.close()


def test_a_pool_short_of_blocks_takes_back_the_kept_ones_first(demo_model_dir):
    prefill = engine(kv_role="prefill", num_kv_blocks="40", max_num_batched_tokens="512")
    try:
        prefill_all(prefill, [PROMPTS[4]])  # 18 blocks kept
        assert prefill.kv_transfer.num_pinned_blocks == 18
        other = [rng.randrange(10, 8000) for _ in range(400)]  # 26 blocks: more than the 21 left
        result = prefill.generate([other], greedy(4))[0]
        assert len(result.output_token_ids) == 4 and result.error is None
        assert prefill.kv_transfer.num_pinned_blocks == 0 and prefill.stats().kv_transfer_reclaimed_pins == 1
        assert prefill.scheduler.num_preemptions == 0
    finally:
        prefill.close()


def pull(port: int, *frames: bytes, timeout_ms: int = 5000) -> PullHeader:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(timeout_ms), "the transfer server did not answer"
        return msgspec.msgpack.decode(sock.recv_multipart()[0], type=PullHeader)
    finally:
        sock.close(0)


def pull_request(token: str, first: int = 0, count: int = 1) -> bytes:
    return msgspec.msgpack.encode(PullRequest(token, first, count))


def test_tokens_read_their_own_blocks_once_and_malformed_pulls_are_refused(pair):
    prefill, decode = pair
    finals = prefill_all(prefill, PROMPTS[3:5])
    port = prefill.kv_transfer.port
    first, second = (f.kv_transfer_params["transfer_token"] for f in finals)
    refusals = [
        (pull(port, b"\x00garbage"), "malformed pull"),
        (pull(port, b"a", b"b", b"c"), "malformed pull"),
        (pull(port, msgspec.msgpack.encode(["x" * 43, 0, 1, "extra"])), "malformed pull"),
        (pull(port, pull_request("y" * 43)), "unknown, expired or already used transfer_token"),
        (pull(port, pull_request(first, 5, 10)), "are not the request's"),  # its 8 blocks only
        (pull(port, pull_request(first)), "unknown, expired or already used"),  # the bad range used it up
    ]
    for header, reason in refusals:
        assert reason in header.error and header.block_hashes == []
    header = pull(port, pull_request(second, 2, 3))
    assert header.error == "" and len(header.block_hashes) == 3 and header.first_block == 2
    assert "already used" in pull(port, pull_request(second, 2, 3)).error  # a token reads once
    assert prefill.stats().kv_transfer_refused_pulls == 7 and prefill.stats().kv_transfer_served_pulls == 1
    # The server still serves: a fresh prefill and a real pull.
    finals = prefill_all(prefill, PROMPTS[2:3])
    assert decode.generate([PROMPTS[2]], [greedy(transfer=finals[0].kv_transfer_params)])[0].error is None
    assert decode.stats().kv_transfer_pulls == 1


def test_a_wrong_token_or_another_engine_is_recomputed_with_the_same_answer(pair, expected):
    prefill, decode = pair
    finals = prefill_all(prefill, PROMPTS[3:5])
    wrong_token = dict(finals[0].kv_transfer_params, transfer_token="z" * 43)
    other_engine = dict(finals[1].kv_transfer_params, remote_engine_id="another")
    results = decode.generate(PROMPTS[3:5], [greedy(transfer=wrong_token), greedy(transfer=other_engine)])
    assert [r.output_token_ids for r in results] == expected[3:5]
    assert decode.stats().kv_transfer_fallbacks == 2 and decode.stats().kv_transfer_pulls == 0
    assert prefill.stats().kv_transfer_refused_pulls == 1  # the other engine id is refused by the puller


def test_a_peer_not_in_the_list_is_refused_before_anything_is_contacted(pair):
    prefill, decode = pair
    context = zmq.Context.instance()
    listener = context.socket(zmq.ROUTER)
    port = listener.bind_to_random_port("tcp://127.0.0.1")
    try:
        forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port, "transfer_token": "t" * 43}
        with pytest.raises(EngineInputError, match=r"kv_transfer_params.remote_host: 127.0.0.1:\d+ is not one of"):
            decode.check_sampling_params(greedy(transfer=forged))
        # Even a request that skipped the door's check (the engine core's adds) is never sent there.
        decode.add_request("forged", prompt_token_ids=PROMPTS[3], sampling_params=greedy(transfer=forged), check=False)
        outputs = [output for _ in range(200) if decode.has_unfinished_requests() for output in decode.step().outputs]
        assert sum(len(o.new_token_ids) for o in outputs) == MAX_TOKENS and outputs[-1].error is None
        assert decode.stats().kv_transfer_fallbacks == 1
        assert not listener.poll(200)
    finally:
        listener.close(0)


@pytest.mark.parametrize(("value", "message"), [
    ([1], "kv_transfer_params: expected a JSON object"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode: expected a boolean"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, "at most one of them"),
    ({"do_remote_prefill": True, "remote_port": 1, "transfer_token": "t" * 43}, "remote_host: required"),
    ({"do_remote_prefill": True, "remote_host": "h", "transfer_token": "t" * 43}, "remote_port: required"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 70000}, "remote_port: expected a port"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "transfer_token": "../etc"},
     "transfer_token: not a token"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids: expected a list"),
    ({"remote_file": "/etc/passwd"}, "unknown key 'remote_file'"),
])
def test_bad_parameters_are_refused_naming_the_field(value, message):
    with pytest.raises(KVTransferParamsError, match=message):
        parse_kv_transfer_params(value)


def test_roles_take_only_their_own_legs(colocated, pair):
    prefill, decode = pair
    leg = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": prefill.kv_transfer.port,
           "transfer_token": "t" * 43}
    with pytest.raises(EngineInputError, match="do_remote_decode: this model is not a prefill engine"):
        colocated.check_sampling_params(greedy(1, {"do_remote_decode": True}))
    with pytest.raises(EngineInputError, match="do_remote_prefill: this model is not a decode engine"):
        prefill.check_sampling_params(greedy(transfer=leg))
    with pytest.raises(EngineInputError, match="do_remote_decode: this model is not a prefill engine"):
        decode.check_sampling_params(greedy(1, {"do_remote_decode": True}))
    with pytest.raises(EngineInputError, match="kv_transfer_params: a disaggregated request has one sequence"):
        decode.check_sampling_params(SamplingParams(n=2, temperature=1.0,
                                                    kv_transfer_params=parse_kv_transfer_params(leg)))
    assert parse_kv_transfer_params({"do_remote_decode": False, "remote_host": None}) is None  # a plain request
    for plain in (colocated, prefill, decode):  # every role still serves a plain request whole
        assert len(plain.generate([PROMPTS[1]], greedy(3))[0].output_token_ids) == 3


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kv_role": "decode"}, "'kv_transfer_peers': kv_role decode needs"),
    ({"kv_role": "decode", "kv_transfer_peers": "host"}, "'kv_transfer_peers': expected HOST:PORT"),
    ({"kv_role": "decode", "kv_transfer_peers": "h:99999"}, "'kv_transfer_peers': expected HOST:PORT"),
    ({"kv_transfer_peers": "h:1"}, "only a decode engine pulls"),
    ({"kv_transfer_endpoint": "tcp://127.0.0.1:5999"}, "only a prefill engine serves"),
    ({"kv_role": "prefill", "enable_prefix_caching": "false"}, "'kv_role': prefill needs enable_prefix_caching"),
    ({"kv_role": "middle"}, "'kv_role': expected one of both, prefill, decode"),
])
def test_bad_configuration_names_the_parameter(demo_model_dir, overrides, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **overrides)
