"""A decode engine's side of a transfer: pulling a prompt's blocks from a prefill engine.

The KV-cache manager asks for the blocks after its own prefix hit (``pull_async``); the request
keeps its place in the waiting queue while the pull runs on this puller's threads (the batch goes
on without it, as with a load from the offload tier), and the verified blocks are written into the
request's blocks when it is admitted. A pull connects only to a configured peer
(``kv_transfer_peers``; the request's host was checked against them when it arrived, and is
checked again here), sends the request's transfer token, and takes the answer only if every block
is what this request's own tokens say it must be: the same tokens, the same chained hashes, this
cache's dtype and shape. Whatever fails (the peer is gone, the answer is late, refused or
foreign) leaves a shorter verified prefix, and the rest of the prompt is computed here: the
answer is the same, only slower, and the fallback is counted.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import zmq

from backend.kv_cache.offload.tier import StoredBlock
from backend.kv_transfer.wire import DTYPES, PullHeader, PullRequest, header_decoder, request_encoder
from backend.protocol.kv_transfer import KVTransferParams

logger = logging.getLogger(__name__)

PULL_THREADS = 2


@dataclass(slots=True)
class PullStats:
    pulls: int = 0  # pulls that brought every block asked for
    received_blocks: int = 0
    received_bytes: int = 0
    fallbacks: int = 0  # pulls that failed or brought fewer blocks: the rest was recomputed
    releases: int = 0  # nothing to pull (the local prefix cache had it all): the prefill engine was told
    pull_seconds: list[float] = field(default_factory=list)  # not reported yet


class KVPuller:
    def __init__(self, peers: frozenset[tuple[str, int]], block_shape: tuple[int, ...], dtype: torch.dtype,
                 timeout_seconds: float) -> None:
        """``block_shape``: one block of this cache, [num_layers, 2, block_size, num_kv_heads, head_size]."""
        self.peers = peers
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.timeout_seconds = timeout_seconds
        self.stats = PullStats()
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-transfer-pull")

    def pull_async(self, params: KVTransferParams, first_block: int,
                   expected: list[tuple[int, int | None, tuple[int, ...]]]) -> Future:
        """Pulls the request's blocks ``first_block ..`` (``expected``: each one's hash, parent hash
        and tokens, from this request's own prompt); the future's result is the verified prefix of
        them as StoredBlocks ([] when the pull failed). An empty ``expected`` only releases them."""
        return self._pool.submit(self._pull, params, first_block, expected)

    def engine_stats_fields(self) -> dict:
        """This puller's part of EngineStats (backend/protocol/outputs.py); pull times since the last call."""
        with self._lock:
            stats = self.stats
            seconds, stats.pull_seconds = stats.pull_seconds, []
            return {"kv_transfer_pulls": stats.pulls, "kv_transfer_received_blocks": stats.received_blocks,
                    "kv_transfer_received_bytes": stats.received_bytes, "kv_transfer_fallbacks": stats.fallbacks,
                    "kv_transfer_pull_seconds": seconds}

    def close(self) -> None:
        """Stops pulling: a pull still running fails (its request recomputes, if anyone still waits)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._context.destroy(linger=0)

    # ----- on a pull thread -----------------------------------------------------------------------
    def _pull(self, params: KVTransferParams, first_block: int, expected) -> list[StoredBlock]:
        start = time.perf_counter()
        try:
            blocks = self._fetch(params, first_block, expected)
        except Exception as exc:  # the peer is gone, late, refused or answered something else
            logger.warning("KV transfer: pulling %d blocks from %s:%d failed (%s); recomputing them",
                           len(expected), params.remote_host, params.remote_port, exc)
            blocks = []
        seconds = time.perf_counter() - start
        with self._lock:
            stats = self.stats
            if not expected:
                stats.releases += 1
            elif len(blocks) == len(expected):
                stats.pulls += 1
                stats.pull_seconds.append(seconds)
            else:
                stats.fallbacks += 1
            stats.received_blocks += len(blocks)
            stats.received_bytes += sum(b.nbytes for b in blocks)
        return blocks

    def _fetch(self, params: KVTransferParams, first_block: int, expected) -> list[StoredBlock]:
        peer = (params.remote_host, params.remote_port)
        if peer not in self.peers:  # checked at the door too: a request never picks a host
            raise PermissionError(f"{peer[0]}:{peer[1]} is not in kv_transfer_peers")
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{_bracketed(peer[0])}:{peer[1]}")
            sock.send(request_encoder.encode(PullRequest(params.transfer_token, first_block, len(expected))))
            if not sock.poll(self.timeout_seconds * 1000, zmq.POLLIN):
                raise TimeoutError(f"no answer within {self.timeout_seconds:g} s "
                                   "(parameter kv_transfer_pull_timeout_seconds)")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(0)
        header = header_decoder.decode(frames[0].buffer)
        if header.error:
            raise RuntimeError(f"refused: {header.error}")
        if params.remote_engine_id and header.engine_id != params.remote_engine_id:
            raise RuntimeError("the peer is another engine than the one that prefilled the request")
        return self._verified_blocks(header, frames[1:], expected)

    def _verified_blocks(self, header: PullHeader, layer_frames, expected) -> list[StoredBlock]:
        count = len(header.block_hashes)
        num_layers, block = self.block_shape[0], self.block_shape[1:]
        if DTYPES.get(header.dtype) != self.dtype or header.num_layers != num_layers or tuple(header.block_shape) != block:
            raise RuntimeError(f"incompatible cache: {header.dtype} {header.num_layers} x {header.block_shape}, "
                               f"here {self.dtype} {num_layers} x {list(block)}")
        if count > len(expected) or len(header.token_ids) != count or len(layer_frames) != (num_layers if count else 0):
            raise RuntimeError("malformed answer")
        if not count:
            return []
        with warnings.catch_warnings():  # read-only buffers: they are only read, by the stack below
            warnings.simplefilter("ignore", UserWarning)
            layers = [torch.frombuffer(frame.buffer, dtype=torch.uint8).view(self.dtype).view(count, *block)
                      for frame in layer_frames]
        kv = torch.stack(layers, dim=1)  # [count, num_layers, 2, block_size, heads, head_size], owned
        blocks = []
        for index, (block_hash, parent_hash, token_ids) in enumerate(expected[:count]):
            sent_parent = header.parent_hash if index == 0 else header.block_hashes[index - 1]
            if (header.block_hashes[index] != block_hash or sent_parent != parent_hash
                    or tuple(header.token_ids[index]) != tuple(token_ids)):
                break  # not this request's block: the rest is recomputed
            blocks.append(StoredBlock(block_hash, parent_hash, tuple(token_ids), kv[index]))
        return blocks


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host

