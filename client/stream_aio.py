"""One gRPC stream on tritonclient's asyncio client: requests one after another, each read as
client.stream reads them (the same StreamResult, the same one-final rule).

Why a second client: tritonclient's threaded client gives each stream its own threads (gRPC's
channel and stream threads, and the caller's), so every response crosses three threads; a load
generator holding 64 streams on the two cores that also run the server spent about 0.3 CPU ms per
response there. Here every stream is a coroutine on one event loop, as vLLM's benchmark clients are.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import tritonclient.grpc.aio as grpcclient_aio

from client.stream import StreamResult, build_inputs, error_message, read_response

EMPTY_FINAL = {"triton_enable_empty_final_response": True}  # what async_stream_infer's flag sets


class StreamClosed(RuntimeError):
    """The server ended the stream while a request on it still waited for its final response."""


class AioStreamingClient:
    """One bidirectional gRPC stream; ``generate`` sends a request and reads its responses. One
    request at a time: errors on a stream name no request."""

    def __init__(self, url: str, model_name: str = "llm", headers: dict[str, str] | None = None):
        self.model_name = model_name
        self.client = grpcclient_aio.InferenceServerClient(url=url)
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses = self.client.stream_infer(self._request_stream(), headers=headers)

    async def _request_stream(self):
        while (request := await self._requests.get()) is not None:
            yield request

    async def generate(self, prompt: str | None, timeout: float = 300.0, on_response=None,
                       **options) -> StreamResult:
        """Sends one request and reads until its final response; raises TimeoutError past
        ``timeout`` (the stream is then unusable: close it)."""
        request_id = uuid.uuid4().hex
        result = StreamResult(start_time=time.monotonic())
        await self._requests.put({"model_name": self.model_name, "inputs": build_inputs(prompt, **options),
                                  "request_id": request_id, "parameters": EMPTY_FINAL})
        deadline = result.start_time + timeout
        while not result.num_final:
            try:
                response, error = await asyncio.wait_for(self._responses.__anext__(),
                                                         max(deadline - time.monotonic(), 0.0))
            except StopAsyncIteration:
                raise StreamClosed(f"the stream ended before request {request_id}'s final response") from None
            now = time.monotonic()
            if error is not None:  # Triton ends a request with its error
                result.error = error_message(error)
                result.num_final += 1
            elif response.get_response().id == request_id:
                read_response(result, response, now)
                if on_response is not None:
                    on_response(request_id, result)
            result.end_time = now
        return result

    async def close(self, cancel_requests: bool = False) -> None:
        """Ends the stream (cancelling what it still carries when asked) and the channel."""
        if cancel_requests:
            self._responses.cancel()
        self._requests.put_nowait(None)
        await self.client.close()
