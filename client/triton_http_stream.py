"""Streaming generation over Triton's HTTP generate extension (``POST
/v2/models/{model}/generate_stream``, server-sent events), timed like client.stream.

Why a third way to reach the same `llm` model: every gRPC response costs tritonclient's machinery
(gRPC's threads, protobuf, a numpy array per output); a load generator on the cores the server
uses spent 0.44 CPU ms per token there, where vLLM's benchmark client, plain HTTP lines of JSON,
spent 0.08 (perf/RESULTS.md). Here a response is one JSON line on a kept-alive connection
(client.keepalive_http): what a user of Triton's generate endpoint holds.

The request is the inputs by name as JSON fields (``text_input``, ``max_tokens``, ...; a
``sampling_parameters`` dict goes as its JSON text), each event the outputs by name. The stream
ends after the request's final response, so its end counts as the one final response.
"""

from __future__ import annotations

import json
import time
from urllib.parse import quote

from client.keepalive_http import KeepAliveClient
from client.stream import StreamResult


def _first(value):
    """An output's value: Triton's JSON gives a one-element tensor as a scalar or a one-item list."""
    return value[0] if isinstance(value, list) and value else value


class TritonHTTPStreamingClient(KeepAliveClient):
    """One kept-alive connection to tritonserver's HTTP port (``url``: ``host:port``) for ``model``;
    one request at a time."""

    def __init__(self, url: str, model: str = "llm", timeout_s: float = 600.0):
        super().__init__(url, timeout_s)
        self.path = f"/v2/models/{quote(model, safe='')}/generate_stream"

    def generate(self, prompt: str, on_response=None, **inputs) -> StreamResult:
        """Streams one request (``inputs``: the `llm` model's input names, docs/llm-model.md);
        ``on_response(None, result)`` runs after each response that carried tokens."""
        fields = {"text_input": prompt}
        for name, value in inputs.items():
            if value is not None:
                fields[name] = json.dumps(value) if isinstance(value, dict) else value
        result = StreamResult(start_time=time.monotonic())
        self.stream_events(self.path, json.dumps(fields).encode("utf-8"), {}, result,
                           lambda event, now: self._read_event(result, event, now, on_response))
        result.num_final = 1
        result.end_time = time.monotonic()
        return result

    @staticmethod
    def _read_event(result: StreamResult, event: dict, now: float, on_response) -> None:
        text = event.get("text_output")
        text = "".join(text) if isinstance(text, list) else (text or "")
        ids = event.get("output_ids")
        ids = ids if isinstance(ids, list) else ([] if ids is None else [ids])
        if event.get("finish_reason"):
            result.finish_reason = str(_first(event["finish_reason"]))
        if event.get("num_input_tokens") is not None:
            result.num_input_tokens = int(_first(event["num_input_tokens"]))
        if event.get("num_output_tokens") is not None:
            result.num_output_tokens = int(_first(event["num_output_tokens"]))
        if not (text or ids):
            return
        result.token_ids.extend(int(i) for i in ids)
        result.add_text(text, now)
        if on_response is not None:
            on_response(None, result)
