"""The messages between the front end (Triton's stub process) and the engine-core process.

msgpack via msgspec: typed decoding (a bad frame fails loudly), and cheap to encode and decode
next to a step (perf/RESULTS.md). Batched both ways: one ``CoreInput`` carries every
request the front end got since its last message, one ``CoreOutputs`` every request's new tokens
of a step. Times are ``time.monotonic()`` seconds, one clock for every process of the machine.
"""

from __future__ import annotations

import msgspec

from backend.protocol.outputs import EngineStats, RequestOutput
from backend.protocol.sampling import SamplingParams

# A file in the core's folder where a core that ends itself says why (a tensor-parallel rank died);
# the front end puts it in the error of every request it fails (process_handle.CoreProcess.describe_exit).
EXIT_REASON_FILE = "exit_reason"


class AddRequest(msgspec.Struct, array_like=True):
    """A checked, tokenized request for the engine (the front end made the sampling check)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class CoreInput(msgspec.Struct, tag="input", array_like=True):
    """What the front end sends: new requests, aborts, and control."""

    adds: list[AddRequest] = []
    aborts: list[str] = []
    drain_grace: float | None = None  # start draining: requests still running after this many seconds end
    shutdown: str | None = None  # end every request with this message and exit
    step: bool = False  # step-on-demand cores (llm_iterative): run one step and answer


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The core loaded its model and listens; what the front end needs to check requests."""

    pid: int
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """The core could not start (the message names why); it exits after sending this."""

    message: str


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One step's outputs (or none: a heartbeat) with the engine's statistics after it."""

    outputs: list[RequestOutput]
    stats: EngineStats
    num_adds_seen: int  # requests received since the core started (the front end's queue arithmetic)
    sent_at: float  # monotonic time just before encoding: receive time minus this is the IPC cost
    stepped: bool = False  # a step ran (the heartbeat-only messages have False)
    final: bool = False  # the last message: the core exits after it
    answers: int = 0  # CoreInput messages taken since the last CoreOutputs (0: a heartbeat or a free-running step)


CoreMessage = CoreReady | CoreFailed | CoreOutputs


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)
