"""Streaming completions over an OpenAI-compatible HTTP endpoint (vLLM, TGI, ...), timed like client.stream.

The load generator talks to our Triton ``llm`` model through ``client.stream`` and to peer serving
stacks through this module, so both sides of a comparison are measured by the same code path above
the wire: a ``StreamResult`` with the client-side arrival time of every chunk that carried text.

One ``OpenAIStreamingClient`` holds one keep-alive HTTP/1.1 connection (standard library only) and
carries one request at a time, like one gRPC stream of the load generator. Requests go to
``/v1/completions`` with ``stream: true``, greedy decoding, ``ignore_eos`` (a vLLM extension that
forces the output length) and ``stream_options.include_usage`` so the server reports its own
prompt and completion token counts in the last chunk.
"""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

from client.stream import StreamResult


class OpenAIStreamingClient:
    """One connection to ``url`` (e.g. ``http://127.0.0.1:8000``) serving ``model``."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http":
            raise ValueError(f"url: only http:// is supported, got {url!r}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.model, self.timeout_s = model, timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def close(self, cancel_requests: bool = False) -> None:
        """Closes the connection; a server like vLLM aborts a request whose client went away."""
        del cancel_requests  # closing the socket is how an HTTP client cancels
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> OpenAIStreamingClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(self, prompt: str, max_tokens: int, ignore_eos: bool = True, on_chunk=None,
                 headers: dict[str, str] | None = None) -> StreamResult:
        """Streams one completion; ``on_chunk(result)`` runs after each chunk that carried text.
        ``headers`` go with the request (a router's session key, say)."""
        body = json.dumps({
            "model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0,
            "ignore_eos": bool(ignore_eos), "stream": True, "stream_options": {"include_usage": True},
        }).encode("utf-8")
        result = StreamResult(start_time=time.monotonic())
        response = self._send(body, {"Content-Type": "application/json", "Accept": "text/event-stream",
                                     **(headers or {})})
        if response.status != 200:
            detail = response.read().decode("utf-8", "replace")[:500]
            result.error = f"HTTP {response.status}: {detail}"
            result.end_time = time.monotonic()
            return result
        for raw_line in response:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                response.read()  # drain the end of the chunked body so the connection can be reused
                break
            now = time.monotonic()
            self._read_chunk(result, json.loads(payload), now, on_chunk)
        result.num_final = 1
        result.end_time = time.monotonic()
        if result.error is None and result.num_output_tokens is None:
            result.error = "the stream ended without a usage chunk (token counts unknown)"
        return result

    def _send(self, body: bytes, headers: dict[str, str]) -> http.client.HTTPResponse:
        """POSTs on the kept-alive connection. A server (or proxy: nginx's keepalive_timeout) may
        have closed it while it sat idle; then the request never reached it, and it goes once more
        on a new connection, as pooled HTTP clients do."""
        for attempt in (0, 1):
            reused = self._connection is not None
            if self._connection is None:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                self._connection.request("POST", "/v1/completions", body=body, headers=headers)
                return self._connection.getresponse()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self.close()
                if not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _read_chunk(result: StreamResult, chunk: dict, now: float, on_chunk) -> None:
        if "error" in chunk:
            result.error = str(chunk["error"])
            return
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or ""
            if text:
                result.text += text
                result.deltas.append(text)
                result.token_times.append(now)
                result.num_responses += 1
                if result.first_token_time is None:
                    result.first_token_time = now
                if on_chunk is not None:
                    on_chunk(result)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            result.num_input_tokens = usage.get("prompt_tokens")
            result.num_output_tokens = usage.get("completion_tokens")
