"""The messages of one pull between a decode engine and a prefill engine (msgpack via msgspec).

A decode engine's DEALER sends one ``PullRequest``; the prefill engine's ROUTER answers with a
``PullHeader`` frame and, when it sends blocks, one frame per layer: the key and value of every
block asked for, ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` in the cache's dtype
(one bulk read of each layer, not one message per block).
"""

from __future__ import annotations

import msgspec
import torch

MAX_REQUEST_BYTES = 4096  # a PullRequest is a token and two integers
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class PullRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    transfer_token: str
    first_block: int  # index into the request's pinned prompt blocks
    num_blocks: int  # 0: nothing to read, release the blocks now (the decode side hit its own cache)


class PullHeader(msgspec.Struct, array_like=True):
    error: str = ""  # non-empty: refused, and no layer frames follow
    engine_id: str = ""
    dtype: str = ""
    num_layers: int = 0
    block_shape: list[int] = []  # one layer's one block: [2, block_size, num_kv_heads, head_size]
    first_block: int = 0
    block_hashes: list[int] = []  # of the blocks sent, chained (hash i's parent is hash i - 1)
    parent_hash: int | None = None  # the first sent block's parent (None: it starts the prompt)
    token_ids: list[list[int]] = []  # each sent block's tokens


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(PullRequest)
header_decoder = msgspec.msgpack.Decoder(PullHeader)
