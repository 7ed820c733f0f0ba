"""The front's optional API keys (``--api-key``, or ``OPENAI_FRONT_API_KEY``), and who a request is.

With keys set, every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``
(the header the openai SDK sends); anything else is 401. The check hashes the presented and every
configured key to the same length and compares all of them with ``hmac.compare_digest``, so its
time says nothing about how much of a key was right, nor which key matched. Keys are never logged
or echoed. A key may carry a name (``NAME=KEY``): the client's identity for per-client limits is
that name (``key1``, ``key2``... for unnamed keys), which a request's ``user`` field cannot change;
without keys it is the request's ``user`` (one shared identity for requests that send none).
"""

from __future__ import annotations

import hashlib
import hmac

OPEN_PATHS = frozenset({"/health", "/metrics"})


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    def __init__(self, keys: list[str] | tuple[str, ...] = ()):
        self._keys: list[tuple[str, bytes]] = []  # (identity, sha256 of the key)
        for number, entry in enumerate(keys, 1):
            name, sep, key = entry.partition("=")
            if not sep:
                name, key = f"key{number}", entry
            if not key:
                raise ValueError(f"--api-key number {number}: empty")
            self._keys.append((name, _digest(key)))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str | None:
        """The identity of the key in an ``Authorization`` header; None when it matches none."""
        presented = ""
        if authorization and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        digest = _digest(presented)
        found = None
        for name, expected in self._keys:  # every key is compared, whichever matches
            if hmac.compare_digest(digest, expected) and found is None:
                found = name
        return found if presented else None
