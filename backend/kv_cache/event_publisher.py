"""Publishing KV-cache event batches on ZMQ the way vLLM does, without ever blocking a step.

The wire is vLLM's ``ZmqEventPublisher``: a PUB socket sends ``(topic, sequence, payload)`` with the
sequence an 8-byte big-endian counter from 0 and the payload a msgpack ``KVEventBatch``
(backend/kv_cache/kv_events.py); an optional ROUTER socket answers replay requests from a
subscriber that joined late or missed a sequence: it sends the 8-byte sequence to start from and
gets every buffered batch from there, then an end marker (sequence -1, empty topic and payload).

The engine hands batches over with :meth:`KVEventPublisher.publish`, which only puts them on a
bounded queue: when the queue is full (the publisher thread cannot keep up) the batch is dropped
and counted, and the step goes on. A PUB socket with no subscriber drops what it sends, so events
nobody reads cost their encoding only. A malformed replay request is answered with the end marker
and the reason as its payload, so the asking client is not left waiting.

Both sockets bind the configured ``tcp://HOST:PORT`` (loopback by default in config.pbtxt); routers
connect to it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from backend.config import KVEventsConfig
from backend.kv_cache.kv_events import TIER_MEDIUM, KVEventBatch, KVEventLog

logger = logging.getLogger(__name__)

END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
POLL_SECONDS = 0.05
FIRST_SUBSCRIBER_WAIT_SECONDS = 10.0


@dataclass(slots=True)
class PublisherStats:
    published_batches: int = 0
    dropped_batches: int = 0  # the queue was full
    replay_requests: int = 0
    bad_replay_requests: int = 0


class KVEventPublisher:
    """One XPUB socket (a PUB that hears subscriptions) and optionally one replay ROUTER socket, served
    by one thread."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str = "", buffer_steps: int = 10_000,
                 max_queued_batches: int = 1_000, log: KVEventLog | None = None) -> None:
        """``log``: where the engine's hooks record events; :meth:`flush` publishes what it holds."""
        self.log = log
        self._flush_lock = threading.Lock()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.stats = PublisherStats()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queued_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.XPUB)  # a PUB that also hears subscriptions arrive
        self._replay = self._context.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"KV events: cannot bind {exc.strerror}: "
                          f"kv_events_endpoint {endpoint!r}, kv_events_replay_endpoint {replay_endpoint!r}") from None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queues ``batch`` for sending; never blocks (a full queue drops it and counts it)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.stats.dropped_batches += 1

    def flush(self) -> None:
        """Publishes the log's events as one batch (the engine after each step, the offload writer
        when its queue empties); one lock keeps batches in the order they were taken."""
        if self.log is None or not len(self.log):
            return
        with self._flush_lock:
            batch = self.log.take()
            if batch is not None:
                self.publish(batch)

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is queued (up to ``timeout``), then closes the sockets (idempotent)."""
        if not self._thread.is_alive():
            return
        self._stopping.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the thread sees _stopping once the queue is empty
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %.1f s", timeout)

    # ----- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        """Sends each batch live and keeps it for replay. Until the first subscriber arrives (at most
        FIRST_SUBSCRIBER_WAIT_SECONDS) batches are numbered and kept for replay but held back from
        the live socket: a router that knew this engine's predecessor (a restart on the same port)
        takes a sequence lower than the last it saw for a restart and replays from 0, and sequence
        0 is what it would otherwise miss while it reconnects (vllm-router 0.1.17 then took the
        next batch for more of the old engine's and dropped its stores as having unknown parents)."""
        encoder = msgspec.msgpack.Encoder()
        sequence = 0
        held: list[tuple[int, bytes]] = []
        live_from = time.monotonic() + FIRST_SUBSCRIBER_WAIT_SECONDS
        try:
            while True:
                while self._pub.poll(0):
                    self._pub.recv()  # b"\x01" + topic: a subscription (or b"\x00": one ended)
                    live_from = 0.0
                if held and (time.monotonic() >= live_from or self._stopping.is_set()):
                    for number, payload in held:
                        self._send(number, payload)
                    held = []
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._answer_replay()
                try:
                    batch = self._queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if self._stopping.is_set() and not held:
                        return
                    continue
                if batch is None:
                    self._stopping.set()
                    continue
                payload = encoder.encode(batch)
                self._buffer.append((sequence, payload))
                if time.monotonic() >= live_from:
                    self._send(sequence, payload)
                else:
                    held.append((sequence, payload))
                self.stats.published_batches += 1
                sequence += 1
        except Exception:
            logger.exception("KV events: the publisher thread failed; no more events are published")
        finally:
            self._close_sockets()

    def _send(self, sequence: int, payload: bytes) -> None:
        self._pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        self.stats.replay_requests += 1
        client = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.stats.bad_replay_requests += 1
            sizes = ", ".join(str(len(frame)) for frame in frames[1:])
            reason = (f"bad replay request: expected an empty delimiter frame and an 8-byte big-endian start "
                      f"sequence, got frames of {sizes or 'no'} bytes").encode()
            self._replay.send_multipart((client, b"", b"", END_SEQUENCE, reason))
            return
        start = int.from_bytes(frames[2], "big")
        for sequence, payload in self._buffer:
            if sequence >= start:
                self._replay.send_multipart((client, b"", self.topic, sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQUENCE, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


def publisher_from_config(config: KVEventsConfig, kv_cache_manager, offloader=None) -> KVEventPublisher | None:
    """The engine's publisher with its hooks in the block pool and the offload tier (both publish
    into one log); None when ``kv_events_endpoint`` is empty. Raises OSError when it cannot bind."""
    if not config.enabled:
        return None
    log = KVEventLog(kv_cache_manager.block_size)
    publisher = KVEventPublisher(config.kv_events_endpoint, config.kv_events_topic,
                                 config.kv_events_replay_endpoint, config.kv_events_buffer_steps, log=log)
    kv_cache_manager.block_pool.events = log
    if offloader is not None:
        medium = TIER_MEDIUM.get(offloader.tier.name, offloader.tier.name.upper())
        offloader.on_stored = lambda block: log.stored(block.block_hash, block.parent_hash, block.token_ids, medium)
        offloader.tier.on_removed = lambda block_hash: log.removed(block_hash, medium)
        offloader.on_idle = publisher.flush
    log.cleared()  # a new engine holds nothing: whatever a router knew of an earlier one is gone
    publisher.flush()
    logger.info("KV events: publishing on %s (topic %r, replay %s)", config.kv_events_endpoint,
                config.kv_events_topic, config.kv_events_replay_endpoint or "off")
    return publisher
