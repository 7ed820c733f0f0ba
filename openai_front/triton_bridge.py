"""The front's one connection to tritonserver: `llm` generations over gRPC streams, readiness, tokenizer.

Each generation is its own bidirectional gRPC stream (tritonclient.grpc.aio) with one request,
always streamed from Triton (``stream`` true; the front gathers the pieces for a non-streaming
answer), with the vLLM backend's ``return_*`` flags so every response carries its finish reason
and token counts, and empty final responses enabled so the end of the request is seen even when
the last response carried nothing. Only the outputs the front reads are requested. Leaving the
iterator early (a client that went away) cancels the gRPC call, which Triton passes to the model
as a cancellation: the engine aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from openai_front.errors import ApiError, from_triton

BASE_OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens")
# How long the model's config.pbtxt parameters are reused: every request reads one, and a config
# changes only when Triton reloads the model.
CONFIG_TTL_SECONDS = 5.0


@dataclass(slots=True)
class Piece:
    """What one Triton response brought for one sample of a generation."""

    index: int  # the sample (sequence_index; 0 with n = 1)
    text: str
    num_output_tokens: int  # tokens of this response
    num_input_tokens: int | None
    finish_reason: str | None  # "stop" / "length" / "abort" on the sample's last piece, else None
    logprobs: list[dict] = field(default_factory=list)  # per token: {"<id>": {"logprob", "rank", "decoded_token"}}
    kv_transfer_params: dict | None = None  # a prefill engine's final answer: where to pull the prompt's KV
    num_cached_tokens: int | None = None  # of the prompt, found in a cache rather than computed (with num_input_tokens)


def _tensor(name: str, array: np.ndarray) -> InferInput:
    tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)


def generation_inputs(prompt: str | list[int] | None, messages: list | None, sampling: dict, echo: bool,
                      logprobs: bool) -> list[InferInput]:
    """The `llm` inputs of one generation: the prompt as text_input, its token ids as input_ids, or
    the chat as messages; streamed, with vLLM's return_* counts."""
    if messages is not None:
        inputs = [_tensor("messages", _text(json.dumps(messages)))]
    elif isinstance(prompt, list):
        inputs = [_tensor("input_ids", np.array([prompt], dtype=np.int32))]
    else:
        inputs = [_tensor("text_input", _text(prompt))]
    inputs += [_tensor("stream", np.array([[True]])), _tensor("exclude_input_in_output", np.array([[not echo]])),
               _tensor("sampling_parameters", _text(json.dumps(sampling)))]
    for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"):
        inputs.append(_tensor(flag, np.array([[True]])))
    if logprobs:
        inputs.append(_tensor("return_logprobs", np.array([[True]])))
    return inputs


def _pieces(result) -> list[Piece]:
    """The pieces of one response (one per sample it carries; none for an empty final response)."""
    raw = result.get_response()
    names = {output.name for output in raw.outputs}
    if "text_output" not in names:
        return []
    texts = [t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1)]
    column = len(texts)

    def values(name, default):
        if name not in names:
            return [default] * column
        return result.as_numpy(name).reshape(-1).tolist()

    reasons = [r.decode() if isinstance(r, bytes) else r for r in values("finish_reason", b"None")]
    counts = values("num_output_tokens", 0)
    inputs = values("num_input_tokens", None)
    cached = values("num_cached_tokens", None)
    indexes = values("sequence_index", 0)
    logprobs = [json.loads(t) if t else [] for t in values("logprobs", b"[]")]
    transfers = [json.loads(t) if t else None for t in values("kv_transfer_params", b"")]
    return [Piece(int(indexes[i]), texts[i], int(counts[i]), None if inputs[0] is None else int(inputs[0]),
                  None if reasons[i] in ("None", "") else reasons[i], logprobs[i] or [], transfers[i],
                  None if cached[0] is None else int(cached[0]))
            for i in range(column)]


class TritonBridge:
    def __init__(self, url: str, model: str, tokenizer_model: str = "tokenizer"):
        self.url = url
        self.model = model
        self.tokenizer_model = tokenizer_model
        self.client = grpcclient_aio.InferenceServerClient(url)
        self._parameters: dict = {}
        self._parameters_read_at = float("-inf")
        self._adapters: tuple[str, ...] = ()
        self._adapters_read_at = float("-inf")

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except InferenceServerException:
            return False

    async def max_model_len(self) -> int | None:
        """config.pbtxt's max_model_len of the model (None when it does not say)."""
        return await self._int_parameter("max_model_len")

    async def default_max_tokens(self) -> int | None:
        """config.pbtxt's default_max_tokens of the model: what a request that names no max_tokens
        gets (None when it does not say)."""
        return await self._int_parameter("default_max_tokens")

    async def reasoning_parser(self) -> str | None:
        """config.pbtxt's reasoning_parser of the model (a front parameter the backend ignores)."""
        return (await self._parameter("reasoning_parser") or "").strip() or None

    async def _int_parameter(self, name: str) -> int | None:
        """A config.pbtxt parameter of the model as an integer (None when absent or unreadable)."""
        value = await self._parameter(name)
        return int(value) if value and value.isdigit() else None

    async def _parameter(self, name: str) -> str | None:
        """A config.pbtxt parameter of the model (read at most once per CONFIG_TTL_SECONDS)."""
        if time.monotonic() - self._parameters_read_at > CONFIG_TTL_SECONDS:
            try:
                config = await self.client.get_model_config(self.model, as_json=True)
            except InferenceServerException:
                return None
            self._parameters = config.get("config", {}).get("parameters", {})
            self._parameters_read_at = time.monotonic()
        return self._parameters.get(name, {}).get("string_value")

    async def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the model serves (it answers ``list_lora_adapters``), read at most once
        per CONFIG_TTL_SECONDS; () without enable_lora or when it cannot say."""
        if (await self._parameter("enable_lora") or "").lower() != "true":
            return ()
        if time.monotonic() - self._adapters_read_at > CONFIG_TTL_SECONDS:
            request = {"model_name": self.model, "inputs": [_tensor("list_lora_adapters", np.array([[True]]))],
                       "outputs": [InferRequestedOutput("text_output")]}

            async def requests():
                yield request

            try:
                async for result, error in self.client.stream_infer(requests()):
                    if error is None:
                        text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
                        self._adapters = tuple(entry["name"] for entry in json.loads(text))
                    break
            except (InferenceServerException, ValueError, KeyError, TypeError):
                return self._adapters
            self._adapters_read_at = time.monotonic()
        return self._adapters

    async def generate(self, prompt: str | list[int] | None, messages: list | None, sampling: dict, echo: bool = False,
                       logprobs: bool = False, request_id: str = "") -> AsyncIterator[Piece]:
        """The pieces of one generation as Triton sends them; ApiError when Triton refuses it.
        Closing the iterator before the end cancels the request in Triton."""
        names = [*BASE_OUTPUTS, *(("sequence_index",) if sampling.get("n", 1) > 1 else ()),
                 *(("logprobs",) if logprobs else ()),
                 *(("kv_transfer_params",) if "kv_transfer_params" in sampling else ())]
        request = {"model_name": self.model, "inputs": generation_inputs(prompt, messages, sampling, echo, logprobs),
                   "outputs": [InferRequestedOutput(name) for name in names], "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}

        async def requests():
            yield request

        responses = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True
                    raise from_triton(str(error.message()))
                for piece in _pieces(result):
                    yield piece
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return
        except InferenceServerException as exc:
            finished = True
            raise ApiError(503, f"tritonserver at {self.url}: {exc.message()}", None, "service_unavailable") from None
        except grpc.aio.AioRpcError as exc:  # tritonserver dropped the stream (its stub died, or it did)
            finished = True
            raise ApiError(503, f"tritonserver at {self.url} ended the stream ({exc.details()}): the request is "
                                "lost; retry it", None, "service_unavailable", "stream_lost") from None
        finally:
            if not finished:
                responses.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        inputs = [_tensor("text_input", _text(text)),
                  _tensor("add_special_tokens", np.array([[add_special_tokens]]))]
        result = await self._infer_tokenizer(inputs, "output_ids")
        return result.as_numpy("output_ids").reshape(-1).tolist()

    async def render_chat_ids(self, messages: list) -> list[int]:
        """The prompt ids `llm` computes for these chat messages (its chat template with the
        generation prompt), from the tokenizer model."""
        result = await self._infer_tokenizer([_tensor("messages", _text(json.dumps(messages)))], "output_ids")
        return result.as_numpy("output_ids").reshape(-1).tolist()

    async def detokenize(self, ids: list[int]) -> str:
        inputs = [_tensor("input_ids", np.array([ids], dtype=np.int32).reshape(1, -1))]
        result = await self._infer_tokenizer(inputs, "text_output")
        return result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")

    async def _infer_tokenizer(self, inputs, output: str):
        try:
            return await self.client.infer(self.tokenizer_model, inputs,
                                           outputs=[InferRequestedOutput(output)])
        except InferenceServerException as exc:
            raise from_triton(str(exc.message())) from None
