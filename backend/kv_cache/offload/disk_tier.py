"""The local-disk tier: one file per block in a folder named by the model's fingerprint.

It survives a server restart: at start-up the folder is indexed (least recently used first, by
file time), so a long shared context or a chat session resumed after a restart loads from disk
instead of being recomputed. Block hashes are stable across processes (they hash ints only).

A file is ``MAGIC``, a little-endian u32 header length, a JSON header (fingerprint, block hash,
parent hash, token ids, dtype, shape, payload size, CRC-32 of the payload) and the raw KV bytes.
Writes go to a temporary file that is renamed into place, so a reader never sees half a block;
a file that is truncated, altered or written by another model or format (its fingerprint differs)
fails the check on load, is removed and counted in ``num_rejected``, and is never loaded. The
folder of another fingerprint (another model, dtype or block size sharing ``kv_offload_dir``) is
left alone. Capacity is the sum of our files' sizes; the least recently used go first.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from backend.kv_cache.offload.tier import KVTier, StoredBlock

logger = logging.getLogger(__name__)

MAGIC = b"KVBLOCK1"
SUFFIX = ".kvb"
_LENGTH = struct.Struct("<I")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def file_name(block_hash: int) -> str:
    return f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}{SUFFIX}"


def encode_block(block: StoredBlock, fingerprint: str) -> bytes:
    kv = block.kv.detach().contiguous().cpu()
    payload = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
    header = json.dumps({
        "fingerprint": fingerprint, "block_hash": block.block_hash, "parent_hash": block.parent_hash,
        "token_ids": list(block.token_ids), "dtype": _DTYPE_NAMES[kv.dtype], "shape": list(kv.shape),
        "nbytes": len(payload), "crc32": zlib.crc32(payload),
    }).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


class BlockFileError(ValueError):
    """A block file that must not be loaded (says why)."""


def decode_block(data: bytes, fingerprint: str, block_hash: int | None = None) -> StoredBlock:
    """The block in ``data``; raises BlockFileError when any check fails."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
        raise BlockFileError("not a KV block file")
    start = len(MAGIC) + _LENGTH.size
    (header_length,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start:start + header_length])
    except ValueError as exc:
        raise BlockFileError(f"unreadable header ({exc})") from None
    if header.get("fingerprint") != fingerprint:
        raise BlockFileError("written for another model, dtype, block size or format")
    if block_hash is not None and header.get("block_hash") != block_hash:
        raise BlockFileError("holds another block")
    payload = memoryview(data)[start + header_length:]
    if len(payload) != header.get("nbytes") or zlib.crc32(payload) != header.get("crc32"):
        raise BlockFileError("truncated or altered (size or checksum)")
    dtype = DTYPES.get(header.get("dtype"))
    if dtype is None:
        raise BlockFileError(f"unknown dtype {header.get('dtype')!r}")
    kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header["shape"])
    parent = header.get("parent_hash")
    return StoredBlock(int(header["block_hash"]), None if parent is None else int(parent),
                       tuple(int(t) for t in header["token_ids"]), kv)


class DiskTier(KVTier):
    """Blocks as files under ``root/fingerprint``."""

    name = "disk"
    _entries: OrderedDict[int, int]  # key (the block hash as 64 bits) -> file size

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fingerprint: str) -> None:
        super().__init__(capacity_bytes)
        self.fingerprint = fingerprint
        self.folder = Path(root) / fingerprint[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_rejected = 0  # files that failed a check and were removed
        self._index()

    def _index(self) -> None:
        found = []
        for path in self.folder.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                key = int(path.stem, 16)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._entries[key] = size
            self._used += size
        self._make_room(0)
        if self._entries:
            logger.info("KV offload: %d blocks (%.1f MiB) on disk in %s", len(self._entries), self._used / 2**20,
                        self.folder)

    def _key(self, block_hash: int) -> int:
        """The hash as the 64 bits a file is named by."""
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF

    def _path(self, key: int) -> Path:
        return self.folder / f"{key:016x}{SUFFIX}"

    def _drop(self, key: int) -> None:
        size = self._entries.pop(key, None)
        if size is not None:
            self._used -= size
            self._removed(key)
        self._path(key).unlink(missing_ok=True)

    def store(self, block: StoredBlock) -> bool:
        data = encode_block(block, self.fingerprint)
        if len(data) > self.capacity_bytes:
            return False
        key = self._key(block.block_hash)
        temporary = self.folder / f"{key:016x}.{os.getpid()}.tmp"
        try:
            temporary.write_bytes(data)
            with self.lock:
                self._make_room(len(data) - self._entries.get(key, 0))
                os.replace(temporary, self._path(key))
                self._used += len(data) - self._entries.pop(key, 0)
                self._entries[key] = len(data)
        except OSError as exc:
            logger.warning("KV offload: could not write block file: %s", exc)
            temporary.unlink(missing_ok=True)
            return False
        return True

    def load(self, block_hash: int) -> StoredBlock | None:
        key = self._key(block_hash)
        with self.lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
        path = self._path(key)
        try:
            block = decode_block(path.read_bytes(), self.fingerprint, block_hash)
            os.utime(path)  # recency survives a restart
        except (OSError, BlockFileError) as exc:
            logger.warning("KV offload: %s is not loaded and is removed: %s", path.name, exc)
            with self.lock:
                self._drop(key)
                self.num_rejected += 1
            return None
        return block
