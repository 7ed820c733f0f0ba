"""Streaming completions over an OpenAI-compatible HTTP endpoint (vLLM, TGI, ...), timed like client.stream.

The load generator talks to our Triton ``llm`` model through ``client.stream`` and to peer serving
stacks through this module, so both sides of a comparison are measured by the same code path above
the wire: a ``StreamResult`` with the client-side arrival time of every chunk that carried text.

One ``OpenAIStreamingClient`` holds one keep-alive HTTP/1.1 connection (client.keepalive_http) and
carries one request at a time, like one gRPC stream of the load generator. Requests go to
``/v1/completions`` with ``stream: true``, greedy decoding, ``ignore_eos`` (a vLLM extension that
forces the output length) and ``stream_options.include_usage`` so the server reports its own
prompt and completion token counts in the last chunk.
"""

from __future__ import annotations

import json
import time

from client.keepalive_http import KeepAliveClient
from client.stream import StreamResult


class OpenAIStreamingClient(KeepAliveClient):
    """One connection to ``url`` (e.g. ``http://127.0.0.1:8000``) serving ``model``."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0):
        super().__init__(url, timeout_s)
        self.model = model

    def generate(self, prompt: str, max_tokens: int, ignore_eos: bool = True, on_chunk=None,
                 headers: dict[str, str] | None = None) -> StreamResult:
        """Streams one completion; ``on_chunk(result)`` runs after each chunk that carried text.
        ``headers`` go with the request (a router's session key, say)."""
        body = json.dumps({
            "model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0,
            "ignore_eos": bool(ignore_eos), "stream": True, "stream_options": {"include_usage": True},
        }).encode("utf-8")
        result = StreamResult(start_time=time.monotonic())
        answered = self.stream_events("/v1/completions", body, headers or {}, result,
                                      lambda chunk, now: self._read_chunk(result, chunk, now, on_chunk))
        result.end_time = time.monotonic()
        if answered:
            result.num_final = 1
            if result.error is None and result.num_output_tokens is None:
                result.error = "the stream ended without a usage chunk (token counts unknown)"
        return result

    @staticmethod
    def _read_chunk(result: StreamResult, chunk: dict, now: float, on_chunk) -> None:
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or ""
            if text:
                result.add_text(text, now)
                if on_chunk is not None:
                    on_chunk(result)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            result.num_input_tokens = usage.get("prompt_tokens")
            result.num_output_tokens = usage.get("completion_tokens")
