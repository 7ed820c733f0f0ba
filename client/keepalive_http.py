"""One kept-alive HTTP/1.1 connection (standard library only) that POSTs a streamed request and reads
its server-sent events: what the load generator's HTTP clients (client.openai_stream,
client.triton_http_stream) share."""

from __future__ import annotations

import http.client
import json
import time
from typing import Self
from urllib.parse import urlsplit


class KeepAliveConnection:
    """A connection to ``url`` (``http://host:port``), opened on the first POST and kept."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http":
            raise ValueError(f"url: only http:// is supported, got {url!r}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def close(self) -> None:
        """Closes the connection; a server aborts a streamed request whose client went away."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> http.client.HTTPResponse:
        """POSTs on the kept-alive connection. A server (or proxy: nginx's keepalive_timeout) may
        have closed it while it sat idle; then the request never reached it, and it goes once more
        on a new connection, as pooled HTTP clients do."""
        for attempt in (0, 1):
            reused = self._connection is not None
            if self._connection is None:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                self._connection.request("POST", path, body=body, headers=headers)
                return self._connection.getresponse()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self.close()
                if not reused or attempt:
                    raise
        raise AssertionError("unreachable")


class KeepAliveClient:
    """Base of a streaming client on one ``KeepAliveConnection`` (``self.connection``): closing it
    is how an HTTP client cancels, and the server aborts a streamed request whose client went away."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.connection = KeepAliveConnection(url, timeout_s)

    def close(self, cancel_requests: bool = False) -> None:
        del cancel_requests  # closing the socket is how an HTTP client cancels
        self.connection.close()

    def stream_events(self, path: str, body: bytes, headers: dict[str, str], result, on_event) -> bool:
        """POSTs ``body`` (JSON) for server-sent events and hands each event, parsed, with its arrival
        time to ``on_event(event, now)``; an event carrying ``error`` sets ``result.error`` instead
        (``result``: the client's StreamResult). False, ``result.error`` set, on an answer other than 200."""
        response = self.connection.post(path, body, {
            "Content-Type": "application/json", "Accept": "text/event-stream", **headers})
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read().decode('utf-8', 'replace')[:500]}"
            return False
        for payload in server_sent_events(response):  # "data: {...}" lines, then "data: [DONE]" or the end
            event, now = json.loads(payload), time.monotonic()
            if "error" in event:
                result.error = str(event["error"])
            else:
                on_event(event, now)
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def server_sent_events(response: http.client.HTTPResponse):
    """The payloads (bytes) of a response's ``data:`` lines, until the body ends or ``[DONE]``
    (after which the rest of the body is drained, so the connection can be reused)."""
    for raw_line in response:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            response.read()
            return
        yield payload
