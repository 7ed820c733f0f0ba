"""A prefill engine's side of a transfer: finished prompts' blocks kept (pinned) and served once.

When a ``do_remote_decode`` request finishes (its first token sampled), the KV-cache manager hands
its blocks to ``keep_finished`` before freeing them: the full blocks of its prompt get one more
reference (so no other request can take them) and a fresh unguessable token, and the request's
final answer carries the transfer parameters (vLLM's names: ``remote_engine_id``,
``remote_host``, ``remote_port``, ``remote_block_ids``; plus ``transfer_token``).

A ROUTER socket on ``kv_transfer_endpoint`` answers each ``PullRequest`` (backend/kv_transfer/wire.py)
on its own thread: a known token reads the blocks of its own request, once (the token is gone
after the first pull, whatever it asked); anything else (an unknown, used or expired token, a
range outside the request's blocks, a malformed message) is answered with the reason and changes
nothing. Blocks are given back by the engine thread, which alone touches the block pool
(``take_released``): after their pull, when ``kv_transfer_timeout_seconds`` pass without one,
or when the pool needs them for running requests (``reclaim``, oldest first).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from backend.kv_cache.block_pool import KVCacheBlock
from backend.kv_transfer.handoff import FinishedPrompt
from backend.kv_transfer.wire import DTYPE_NAMES, MAX_REQUEST_BYTES, PullHeader, request_decoder
from backend.protocol.outputs import FinishReason

logger = logging.getLogger(__name__)

POLL_MILLISECONDS = 100
MAX_PINNED_REQUESTS = 4096
ANSWERED_REASONS = (FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)


@dataclass(slots=True)
class ServerStats:
    pinned_requests: int = 0  # requests whose blocks were kept for a pull (cumulative)
    served_pulls: int = 0  # pulls answered with blocks (or an empty release)
    sent_blocks: int = 0
    sent_bytes: int = 0
    refused_pulls: int = 0  # unknown or used tokens, bad ranges, malformed messages
    expired_pins: int = 0  # never pulled within kv_transfer_timeout_seconds
    reclaimed_pins: int = 0  # given up early because running requests needed the blocks


@dataclass(slots=True, eq=False)
class _Pin:
    request_id: str
    blocks: list[KVCacheBlock]  # the prompt's full blocks, each holding one reference for this pin
    block_hashes: list[int]
    token_ids: list[list[int]]
    deadline: float  # monotonic
    root: int | None = None  # what the first block chains to (a LoRA adapter's root, or None)
    reading: bool = False  # the server thread is reading its blocks


@dataclass(slots=True)
class _Released:
    blocks: list[list[KVCacheBlock]] = field(default_factory=list)


def advertised_host(host: str) -> str:
    """The host a decode engine should dial: the bound one, or this machine's name for a wildcard."""
    return socket.gethostname() if host in ("*", "0.0.0.0", "[::]") else host.strip("[]")


class KVTransferServer:
    """Pins finished prompts' blocks and serves each of them to one pull (see the module docstring)."""

    def __init__(self, endpoint: str, kv_caches, block_size: int, timeout_seconds: float) -> None:
        """``endpoint``: tcp://HOST:PORT to bind; empty binds loopback on a free port.
        ``kv_caches``: per layer (key, value), each [num_blocks, block_size, num_kv_heads, head_size]."""
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.timeout_seconds = timeout_seconds
        self.engine_id = uuid.uuid4().hex
        self.stats = ServerStats()
        key = kv_caches[0][0]
        self.dtype_name = DTYPE_NAMES[key.dtype]
        self.block_shape = [2, *key.shape[1:]]
        self._pins: dict[str, _Pin] = {}  # by token
        self._released: list[_Pin] = []  # pulled, to give back on the engine thread
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES * 4)  # drop oversized messages unread
        try:
            if endpoint:
                self._socket.bind(endpoint)
            else:
                self._socket.bind_to_random_port("tcp://127.0.0.1")
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._context.term()
            raise OSError(f"KV transfer: cannot bind {endpoint or 'tcp://127.0.0.1'} ({exc.strerror}): "
                          "parameter kv_transfer_endpoint") from None
        bound = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()  # tcp://HOST:PORT as bound
        host, _, port = bound[len("tcp://"):].rpartition(":")
        self.host, self.port = advertised_host(host), int(port)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-server", daemon=True)
        self._thread.start()

    # ----- the engine thread ----------------------------------------------------------------------
    def keep_finished(self, request: FinishedPrompt, blocks: list[KVCacheBlock], block_hashes: list[int],
                      block_pool) -> None:
        """Called by the KV-cache manager with a finished request's blocks before it frees them:
        a ``do_remote_decode`` request that ended normally keeps its prompt's full blocks (one
        more reference each) and gets its transfer parameters (``request.kv_transfer.params``)."""
        params = request.sampling_params.kv_transfer_params
        if params is None or not params.do_remote_decode or request.finish_reason not in ANSWERED_REASONS:
            return
        num_full = min(request.num_prompt_tokens // self.block_size, len(blocks), len(block_hashes))
        kept = blocks[:num_full]
        block_pool.touch(kept)
        size = self.block_size
        token = secrets.token_urlsafe(32)
        pin = _Pin(request.request_id, kept, list(block_hashes[:num_full]),
                   [request.prompt_token_ids[i * size:(i + 1) * size] for i in range(num_full)],
                   time.monotonic() + self.timeout_seconds, request.kv.hash_root)
        with self._lock:
            self._pins[token] = pin
            overflow = len(self._pins) - MAX_PINNED_REQUESTS
        self.stats.pinned_requests += 1
        if overflow > 0:
            self._give_up(block_pool, overflow)
        request.kv_transfer.params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_host": self.host, "remote_port": self.port, "remote_block_ids": [b.block_id for b in kept],
            "transfer_token": token, "tp_size": 1,
        }

    def take_released(self, block_pool, now: float | None = None) -> int:
        """Gives back the blocks of pins that were pulled or timed out; returns how many blocks."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done, self._released = self._released, []
            expired = [self._pins.pop(token) for token, pin in list(self._pins.items())
                       if pin.deadline <= now and not pin.reading]
            done.extend(expired)
        self.stats.expired_pins += len(expired)
        for pin in expired:
            logger.info("KV transfer: request %s was not pulled within %g s; its %d blocks are freed",
                        pin.request_id, self.timeout_seconds, len(pin.blocks))
        return self._free(block_pool, done)

    def reclaim(self, block_pool, num_blocks: int) -> int:
        """The pool is short of ``num_blocks`` for running requests: pins give theirs up, oldest
        first (their decode engines recompute). Returns how many blocks were freed."""
        return self._give_up(block_pool, None, num_blocks)

    def _give_up(self, block_pool, num_pins: int | None, num_blocks: int = 0) -> int:
        with self._lock:
            victims = []
            freed = 0
            for token, pin in list(self._pins.items()):  # insertion order: oldest first
                if (num_pins is not None and len(victims) >= num_pins) or (num_pins is None and freed >= num_blocks):
                    break
                if pin.reading:
                    continue
                victims.append(self._pins.pop(token))
                freed += sum(1 for b in pin.blocks if b.ref_cnt == 1)
        self.stats.reclaimed_pins += len(victims)
        return self._free(block_pool, victims)

    @staticmethod
    def _free(block_pool, pins: list[_Pin]) -> int:
        num_blocks = 0
        for pin in pins:
            block_pool.free_blocks(reversed(pin.blocks))  # tail first, as a finished request frees
            num_blocks += len(pin.blocks)
        return num_blocks

    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return sum(len(pin.blocks) for pin in self._pins.values())

    def engine_stats_fields(self) -> dict:
        """This server's part of EngineStats (backend/protocol/outputs.py)."""
        stats = self.stats
        return {"kv_transfer_pinned_blocks": self.num_pinned_blocks, "kv_transfer_pinned_requests": stats.pinned_requests,
                "kv_transfer_served_pulls": stats.served_pulls, "kv_transfer_sent_blocks": stats.sent_blocks,
                "kv_transfer_sent_bytes": stats.sent_bytes, "kv_transfer_refused_pulls": stats.refused_pulls,
                "kv_transfer_expired_pins": stats.expired_pins, "kv_transfer_reclaimed_pins": stats.reclaimed_pins}

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2.0)
        self._socket.close(0)
        self._context.term()

    # ----- the server thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(POLL_MILLISECONDS):
                continue
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                logger.exception("KV transfer: receiving failed")
                continue
            try:
                self._answer(frames)
            except Exception:  # never let one message end the server
                logger.exception("KV transfer: answering a pull failed")

    def _answer(self, frames) -> None:
        identity = frames[0].bytes
        payload = frames[-1].buffer if len(frames) >= 2 else b""
        if len(frames) < 2 or len(payload) > MAX_REQUEST_BYTES:
            self._refuse(identity, "malformed pull: expected one PullRequest frame")
            return
        try:
            pull = request_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._refuse(identity, f"malformed pull: {exc}")
            return
        with self._lock:
            pin = self._pins.pop(pull.transfer_token, None)  # read once: gone whatever happens next
            if pin is not None:
                pin.reading = True
        if pin is None:
            self._refuse(identity, "unknown, expired or already used transfer_token")
            return
        try:
            if not (0 <= pull.first_block and 0 <= pull.num_blocks
                    and pull.first_block + pull.num_blocks <= len(pin.blocks)):
                self._refuse(identity, f"blocks {pull.first_block}..{pull.first_block + pull.num_blocks - 1} are "
                             f"not the request's (it has {len(pin.blocks)} full prompt blocks)")
                return
            self._send_blocks(identity, pin, pull.first_block, pull.num_blocks)
        finally:
            with self._lock:
                pin.reading = False
                self._released.append(pin)

    def _send_blocks(self, identity: bytes, pin: _Pin, first: int, count: int) -> None:
        chosen = pin.blocks[first:first + count]
        header = PullHeader(
            engine_id=self.engine_id, dtype=self.dtype_name, num_layers=len(self.kv_caches),
            block_shape=self.block_shape, first_block=first, block_hashes=pin.block_hashes[first:first + count],
            parent_hash=pin.block_hashes[first - 1] if first else pin.root, token_ids=pin.token_ids[first:first + count])
        frames = [identity, msgspec.msgpack.encode(header)]
        if count:
            index = torch.tensor([b.block_id for b in chosen], dtype=torch.int64, device=self.kv_caches[0][0].device)
            for key, value in self.kv_caches:  # one gather per layer: [count, 2, block_size, heads, head_size]
                layer = torch.stack((key.index_select(0, index), value.index_select(0, index)), dim=1).cpu()
                frames.append(layer.view(torch.uint8).numpy())
        self._socket.send_multipart(frames, copy=False)
        self.stats.served_pulls += 1
        self.stats.sent_blocks += count
        self.stats.sent_bytes += sum(f.nbytes for f in frames[2:])

    def _refuse(self, identity: bytes, reason: str) -> None:
        self.stats.refused_pulls += 1
        logger.warning("KV transfer: refused a pull: %s", reason)
        try:
            self._socket.send_multipart([identity, msgspec.msgpack.encode(PullHeader(error=reason))], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
