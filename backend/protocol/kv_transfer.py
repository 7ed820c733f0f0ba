"""A request's ``kv_transfer_params``: vLLM's NIXL-connector fields, read and checked (no torch).

Disaggregated serving sends each request twice (vllm-router's PD mode, or any client doing the
same): to a prefill engine with ``{"do_remote_decode": true}`` and ``max_tokens`` 1, whose final
answer carries the parameters of a transfer (``remote_engine_id``, ``remote_host``,
``remote_port``, ``remote_block_ids`` as vLLM names them, plus our ``transfer_token``); then, with
those parameters and ``do_remote_prefill: true``, to a decode engine, which pulls the prompt's
KV blocks from that prefill engine instead of computing them.

Everything here comes from a client, so it is checked against configuration before anything acts
on it (``check_against``): a decode engine pulls only from its ``kv_transfer_peers``, never from a
host a request names; a request's token reads only its own blocks, once (backend/kv_transfer/server.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# vLLM's keys (NixlConnector's request and answer), ours, and what an OpenAI body may send as null.
KNOWN_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
              "remote_port", "remote_request_id", "tp_size", "transfer_token")
MAX_BLOCK_IDS = 1 << 16
MAX_TEXT_CHARS = 256
_TOKEN = re.compile(r"[A-Za-z0-9_\-]{16,128}")


class KVTransferParamsError(ValueError):
    """A bad ``kv_transfer_params``; the message names the field."""


@dataclass(slots=True)
class KVTransferParams:
    """What a request asks of the transfer (msgspec-encodable: it travels to the engine core)."""

    do_remote_decode: bool = False  # prefill leg: keep the prompt's blocks for a decode engine to pull
    do_remote_prefill: bool = False  # decode leg: pull the prompt's blocks from remote_host:remote_port
    remote_engine_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    remote_block_ids: list[int] | None = None  # what the prefill engine pinned (informational: the token decides)
    transfer_token: str = ""


def parse_kv_transfer_params(value, where: str = "kv_transfer_params") -> KVTransferParams | None:
    """The JSON object a request sent (None or {} for none); KVTransferParamsError naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise KVTransferParamsError(f"{where}: expected a JSON object")
    unknown = sorted(set(value) - set(KNOWN_KEYS))
    if unknown:
        raise KVTransferParamsError(f"{where}: unknown key '{unknown[0]}' (known: {', '.join(KNOWN_KEYS)})")
    params = KVTransferParams(
        do_remote_decode=_flag(value, "do_remote_decode", where),
        do_remote_prefill=_flag(value, "do_remote_prefill", where),
        remote_engine_id=_text(value, "remote_engine_id", where),
        remote_host=_text(value, "remote_host", where),
        remote_port=_port(value, where),
        remote_block_ids=_block_ids(value, where),
        transfer_token=_text(value, "transfer_token", where),
    )
    if params.do_remote_decode and params.do_remote_prefill:
        raise KVTransferParamsError(f"{where}: do_remote_decode and do_remote_prefill: at most one of them")
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None  # a plain request (the router's parameters of a leg that transfers nothing)
    if params.do_remote_prefill:
        for name in ("remote_host", "transfer_token"):
            if not getattr(params, name):
                raise KVTransferParamsError(f"{where}.{name}: required with do_remote_prefill")
        if not params.remote_port:
            raise KVTransferParamsError(f"{where}.remote_port: required with do_remote_prefill")
        if not _TOKEN.fullmatch(params.transfer_token):
            raise KVTransferParamsError(f"{where}.transfer_token: not a token this server issues")
    return params


def check_against(params: KVTransferParams | None, kv_role: str, peers: frozenset[tuple[str, int]],
                  num_samples: int = 1, where: str = "kv_transfer_params") -> None:
    """Whether this engine takes ``params``: its role, and for a pull, a peer it is configured to
    pull from. Raises KVTransferParamsError naming the field; nothing is contacted here or before."""
    if params is None:
        return
    if num_samples > 1:
        raise KVTransferParamsError(f"{where}: a disaggregated request has one sequence (n and beam_width 1)")
    if params.do_remote_decode and kv_role != "prefill":
        raise KVTransferParamsError(f"{where}.do_remote_decode: this model is not a prefill engine "
                                    f"(kv_role {kv_role})")
    if params.do_remote_prefill:
        if kv_role != "decode":
            raise KVTransferParamsError(f"{where}.do_remote_prefill: this model is not a decode engine "
                                        f"(kv_role {kv_role})")
        if (params.remote_host, params.remote_port) not in peers:
            raise KVTransferParamsError(
                f"{where}.remote_host: {params.remote_host}:{params.remote_port} is not one of this engine's "
                "prefill peers (parameter kv_transfer_peers)")


def _flag(value: dict, name: str, where: str) -> bool:
    flag = value.get(name)
    if flag is None:
        return False
    if not isinstance(flag, bool):
        raise KVTransferParamsError(f"{where}.{name}: expected a boolean")
    return flag


def _text(value: dict, name: str, where: str) -> str:
    text = value.get(name)
    if text is None:
        return ""
    if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
        raise KVTransferParamsError(f"{where}.{name}: expected a string of at most {MAX_TEXT_CHARS} characters")
    return text


def _port(value: dict, where: str) -> int:
    port = value.get("remote_port")
    if port is None:
        return 0
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVTransferParamsError(f"{where}.remote_port: expected a port number in 1-65535")
    return port


def _block_ids(value: dict, where: str) -> list[int] | None:
    ids = value.get("remote_block_ids")
    if ids is None:
        return None
    if (not isinstance(ids, list) or len(ids) > MAX_BLOCK_IDS
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
        raise KVTransferParamsError(f"{where}.remote_block_ids: expected a list of at most {MAX_BLOCK_IDS} "
                                    "block ids (integers >= 0)")
    return ids
