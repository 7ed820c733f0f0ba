"""The routing header that pins a session to one replica behind nginx (deploy/nginx.conf).

nginx hashes ``x-session-id`` consistently over the replicas, so every stream that carries the same
value reaches the same tritonserver and finds its KV blocks in that replica's prefix cache. Clients
with a session send its id; clients without one send a stable hash of the prompt's first block of
text, so prompts sharing a system prompt or a long document land together too.
"""

from __future__ import annotations

import hashlib

SESSION_HEADER = "x-session-id"  # gRPC metadata keys are lowercase; nginx reads it as $http_x_session_id
PREFIX_CHARS = 256  # "first block of text": ~64 tokens, a few 16-token KV blocks


def prefix_routing_key(prompt: str, prefix_chars: int = PREFIX_CHARS) -> str:
    """A stable key for the prompt's first ``prefix_chars`` characters (same on every machine)."""
    digest = hashlib.sha256(prompt[:prefix_chars].encode("utf-8")).hexdigest()
    return f"p-{digest[:16]}"


def routing_headers(prompt: str | None = None, session_id: str | None = None,
                    prefix_chars: int = PREFIX_CHARS) -> dict[str, str]:
    """The header to send: the session id when given, else the prompt prefix's key."""
    if session_id:
        return {SESSION_HEADER: session_id}
    if prompt is None:
        raise ValueError("routing_headers needs a session id or a prompt")
    return {SESSION_HEADER: prefix_routing_key(prompt, prefix_chars)}
