"""KV-cache events (issue 32): vLLM's wire format, what the pool and the tiers publish, the ZMQ side.

A router that follows our events must believe exactly what the engine holds: the events of a run,
applied in order to a mirror, give the pool's cached blocks (hash, parent and tokens) and the
offload tier's blocks, and never a block the engine no longer has. The bytes on the wire decode to
vLLM's field names and tags. The publisher never blocks: a full queue drops and counts, a
subscriber that joined late gets the missed batches from the replay socket, and a malformed replay
request is answered with the reason instead of silence.
"""

from __future__ import annotations

import random
import socket
import time

import msgspec
import pytest
import zmq

from backend.config import ConfigError, engine_config_from_model_folder, parse_engine_config
from backend.engine.llm_engine import LLMEngine
from backend.kv_cache.block_pool import BlockPool, hash_block_tokens
from backend.kv_cache.event_publisher import END_SEQUENCE, KVEventPublisher
from backend.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    external_hash,
)
from backend.kv_cache.offload.tier import HostMemoryTier, StoredBlock
from backend.models.demo_model import DEMO_REPOSITORY
from backend.protocol.sampling import SamplingParams

rng = random.Random(32)
PREFIX = [rng.randrange(10, 8000) for _ in range(100)]  # 6 full blocks of 16
FILLERS = [[rng.randrange(10, 8000) for _ in range(150)] for _ in range(4)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class Mirror:
    """What a router knows after applying the events in order: medium -> hash -> (parent, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[int, tuple[int | None, tuple[int, ...]]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                held = self.blocks.setdefault(event.medium, {})
                parent = event.parent_block_hash
                for index, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[index * event.block_size:(index + 1) * event.block_size]
                    held[block_hash] = (parent, tuple(tokens))
                    parent = block_hash
            else:
                held = self.blocks.get(event.medium, {})
                for block_hash in event.block_hashes:
                    assert block_hash in held, "a removal of a block never stored"
                    del held[block_hash]


def pool_view(pool: BlockPool) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    return {external_hash(h): (None if b.parent_hash is None else external_hash(b.parent_hash), b.token_ids)
            for h, b in pool.cached_block_hash_to_block.items()}


# ----- the log and the wire ---------------------------------------------------------------------------
def test_a_chain_of_stored_blocks_is_one_event_and_removals_merge():
    log = KVEventLog(block_size=2)
    log.stored(1, None, [5, 6])
    log.stored(2, 1, [7, 8])
    log.stored(9, 4, [1, 1])  # another parent: a new event
    log.removed(1)
    log.removed(2)
    log.removed(3, "CPU")
    log.cleared()
    batch = log.take()
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                        "BlockRemoved", "AllBlocksCleared"]
    first = batch.events[0]
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([1, 2], None, [5, 6, 7, 8])
    assert batch.events[2].block_hashes == [1, 2] and batch.events[3].medium == "CPU"
    assert log.take() is None


def test_the_wire_has_vllms_fields_tags_and_unsigned_hashes():
    log = KVEventLog(block_size=2)
    log.stored(-5, None, [5, 6])
    log.removed(-5)
    log.cleared()
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(log.take()))
    timestamp, events, rank = raw
    assert isinstance(timestamp, float) and rank == 0
    assert events == [
        {"type": "BlockStored", "block_hashes": [2**64 - 5], "parent_block_hash": None, "token_ids": [5, 6],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [2**64 - 5], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


# ----- what the pool and the tiers record ------------------------------------------------------------
def test_the_pool_records_caching_eviction_and_reset():
    pool = BlockPool(4, enable_caching=True)
    pool.events = log = KVEventLog(block_size=2)
    first, second = pool.get_new_blocks(2)
    h1 = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(first, None, [1, 2], h1)
    pool.cache_full_block(second, h1, [3, 4])
    assert not pool.cache_full_block(pool.get_new_blocks(1)[0], None, [1, 2], h1)  # a duplicate: no event
    pool.free_blocks([second, first])
    pool.get_new_blocks(2)  # reuses the cached free blocks: both evicted
    pool.reset_prefix_cache()
    events = log.take().events
    assert isinstance(events[0], BlockStored) and len(events[0].block_hashes) == 2
    assert isinstance(events[1], BlockRemoved) and set(events[1].block_hashes) == set(events[0].block_hashes)
    assert isinstance(events[2], AllBlocksCleared) and len(events) == 3


def test_the_host_tier_reports_what_it_drops_to_make_room():
    import torch

    kv = torch.zeros(4)
    tier = HostMemoryTier(capacity_bytes=2 * kv.numel() * kv.element_size())
    dropped = []
    tier.on_removed = dropped.append
    for block_hash in (1, 2, 3):
        tier.store(StoredBlock(block_hash, None, (block_hash,), kv))
    assert dropped == [1] and 1 not in tier


def engine(**overrides: str) -> LLMEngine:
    parameters = {"num_kv_blocks": "20", "block_size": "16", **overrides}
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"), **parameters))


def subscriber(context: zmq.Context, address: str) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def received(sub: zmq.Socket, settle: float = 0.3) -> list[tuple[int, KVEventBatch]]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = []
    while sub.poll(int(settle * 1000)):
        _, sequence, payload = sub.recv_multipart()
        batches.append((int.from_bytes(sequence, "big"), decoder.decode(payload)))
    return batches


@pytest.mark.parametrize("tier", ["none", "host"])
def test_a_router_following_the_events_knows_exactly_what_the_engine_holds(demo_model_dir, tier):
    address = endpoint()
    llm = engine(kv_events_endpoint=address, kv_offload_tier=tier, kv_offload_load_policy="always")
    context = zmq.Context()
    sub = subscriber(context, address)
    time.sleep(0.3)  # the subscription reaches the PUB socket
    mirror = Mirror()
    try:
        for prompt in [PREFIX + [1], *FILLERS, PREFIX + [2]]:  # the fillers push the prefix out of the pool
            llm.generate([prompt], [PARAMS])
        if llm.offloader is not None:
            llm.offloader.flush()
        batches = received(sub)
        assert [sequence for sequence, _ in batches] == list(range(batches[0][0], batches[0][0] + len(batches)))
        for _, batch in batches:
            mirror.apply(batch)
        pool = llm.kv_cache_manager.block_pool
        assert mirror.blocks.get("GPU", {}) == pool_view(pool) and pool_view(pool)
        removed = sum(len(e.block_hashes) for _, b in batches for e in b.events
                      if isinstance(e, BlockRemoved) and e.medium == "GPU")
        assert removed > 0  # the small pool evicted, and said so
        if tier == "host":
            held = {external_hash(h) for h in llm.offloader.tier._entries}
            assert set(mirror.blocks["CPU"]) == held and held
        assert llm.stats().kv_events_published_batches >= len(batches)
    finally:
        sub.close(linger=0)
        context.term()
        llm.close()


def test_a_late_subscriber_replays_from_a_sequence_and_a_bad_request_gets_the_reason(demo_model_dir):
    address, replay = endpoint(), endpoint()
    llm = engine(kv_events_endpoint=address, kv_events_replay_endpoint=replay)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        llm.generate([PREFIX, FILLERS[0]], [PARAMS, PARAMS])
        time.sleep(0.2)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            _, topic, sequence, payload = dealer.recv_multipart()
            if sequence == END_SEQUENCE:
                assert payload == b""
                break
            frames.append((int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch)))
        assert [sequence for sequence, _ in frames] == list(range(len(frames)))
        assert isinstance(frames[0][1].events[0], AllBlocksCleared)  # a new engine says it holds nothing
        mirror = Mirror()
        for _, batch in frames:
            mirror.apply(batch)
        assert mirror.blocks["GPU"] == pool_view(llm.kv_cache_manager.block_pool)
        dealer.send_multipart([b"", b"not a sequence"])
        _, topic, sequence, reason = dealer.recv_multipart()
        assert sequence == END_SEQUENCE and b"8-byte big-endian start sequence" in reason
        assert llm.kv_event_publisher.stats.bad_replay_requests == 1
    finally:
        dealer.close(linger=0)
        context.term()
        llm.close()


def test_publishing_never_blocks_a_full_queue_drops_and_counts():
    publisher = KVEventPublisher(endpoint(), max_queued_batches=1)
    publisher.close()  # its thread no longer drains the queue
    batch = KVEventBatch(0.0, [AllBlocksCleared()], 0)
    start = time.perf_counter()
    for _ in range(100):
        publisher.publish(batch)
    assert time.perf_counter() - start < 0.05
    assert publisher.stats.dropped_batches == 99


def test_an_endpoint_already_bound_is_an_error_naming_the_parameter():
    address = endpoint()
    first = KVEventPublisher(address)
    try:
        with pytest.raises(OSError, match="kv_events_endpoint"):
            KVEventPublisher(address)
    finally:
        first.close()


@pytest.mark.parametrize(("parameters", "message"), [
    ({"kv_events_endpoint": "127.0.0.1:5557"}, "kv_events_endpoint': expected tcp://HOST:PORT"),
    ({"kv_events_endpoint": "tcp://127.0.0.1:0"}, "port in 1-65535"),
    ({"kv_events_endpoint": "ipc:///tmp/x"}, "kv_events_endpoint"),
    ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "needs kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5557"},
     "must differ"),
    ({"kv_events_endpoint": "tcp://127.0.0.1:5557", "enable_prefix_caching": "false"}, "enable_prefix_caching"),
    ({"kv_events_topic": "x" * 300}, "kv_events_topic': at most 256"),
])
def test_bad_kv_event_parameters_are_refused_naming_them(parameters, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config({"model_dir": "/m", **parameters})


def test_kv_event_parameters_parse():
    config = parse_engine_config({"model_dir": "/m", "kv_events_endpoint": "tcp://*:5557",
                                  "kv_events_replay_endpoint": "tcp://[::1]:5558", "kv_events_topic": "kv"})
    assert config.kv_events.enabled and config.kv_events.kv_events_topic == "kv"
    assert not parse_engine_config({"model_dir": "/m"}).kv_events.enabled


def test_the_first_batch_waits_for_a_subscriber_so_a_reconnecting_router_sees_the_restart():
    address = endpoint()
    publisher = KVEventPublisher(address)
    context = zmq.Context()
    try:
        publisher.publish(KVEventBatch(0.0, [AllBlocksCleared()], 0))
        publisher.publish(KVEventBatch(1.0, [BlockRemoved([7], "GPU")], 0))
        time.sleep(0.5)  # nobody subscribed yet: a PUB would have sent and lost both
        sub = subscriber(context, address)
        batches = received(sub, settle=1.0)
        assert [sequence for sequence, _ in batches] == [0, 1]
        assert isinstance(batches[0][1].events[0], AllBlocksCleared)
        sub.close(linger=0)
    finally:
        publisher.close()
        context.term()


def test_a_prompts_blocks_are_published_before_its_forward_ends(demo_model_dir):
    """A router must hear of a long prompt's blocks when they are scheduled: a second request for
    the same prefix that arrives during the first one's prefill finds them, in the engine's
    prefix cache and so in the router's index."""
    address = endpoint()
    llm = engine(kv_events_endpoint=address)
    context = zmq.Context()
    sub = subscriber(context, address)
    time.sleep(0.3)
    seen_during_forward: list[int] = []
    forwards = []
    execute = llm.model_runner.execute

    def execute_after_reading_events(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 1:  # the prompt's one prefill step
            for _, batch in received(sub, settle=1.0):
                seen_during_forward.extend(h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes)
        return execute(*args, **kwargs)

    llm.model_runner.execute = execute_after_reading_events
    try:
        llm.generate([PREFIX], [PARAMS])
        prompt_blocks = {external_hash(h) for h in llm.kv_cache_manager.block_pool.cached_block_hash_to_block}
        assert len(seen_during_forward) == len(PREFIX) // 16 and set(seen_during_forward) <= prompt_blocks
    finally:
        sub.close(linger=0)
        context.term()
        llm.close()
