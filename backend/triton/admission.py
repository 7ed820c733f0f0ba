"""From one Triton request to an engine request: the admission path of both `llm` and `llm_iterative`.

``RequestAdmission.admit`` reads and checks the request's tensors (backend/triton/inputs.py, with
the engine's one check of backend/engine/input_processor.py), renders chat messages, tokenizes,
builds the request's ResponseState and its AddRequest, and submits it to the engine client, whose
admission control decides busy and drain (backend/engine_core/admission.py). It never raises: a
request it refuses gets its error response and FINAL flag here (INVALID_ARG naming the field for
bad input, UNAVAILABLE when the engine takes nothing now, INTERNAL for a failure of ours), for
that request only. An accepted request is handed to ``on_accept(state, sender)`` before the engine
can produce anything for it: from then on only whoever took it there answers it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from backend.engine.input_processor import EngineInputError, InputProcessor
from backend.engine_core.admission import BusyError
from backend.engine_core.engine_client import EngineClient
from backend.protocol.messages import AddRequest
from backend.triton.client_priority import DEFAULT_PRIORITY_RANGE, ClientPriorityRange
from backend.triton.helpers import build_response, input_getter, requested_outputs, send_error
from backend.triton.inputs import InputError, as_bool, parse_request, scalar
from backend.triton.response_state import ResponseState

logger = logging.getLogger(__name__)

OnAccept = Callable[[ResponseState, object], None]  # (the request's state, its response sender)


class RequestAdmission:
    def __init__(self, pb, engine: EngineClient, inputs: InputProcessor,
                 max_prompt_bytes: int | None = None, stream_interval: int = 1,
                 priorities: ClientPriorityRange = DEFAULT_PRIORITY_RANGE):
        self.pb = pb
        self.engine = engine
        self.inputs = inputs
        self.max_prompt_bytes = max_prompt_bytes
        self.stream_interval = stream_interval  # config.pbtxt's; a request's sampling_parameters may override it
        self.priorities = priorities  # what a client may claim (backend/triton/client_priority.py)

    def admit(self, request, sender, request_id: str, arrival_time: float, on_accept: OnAccept) -> ResponseState | None:
        """The accepted request's state, or None once it was answered (see the module docstring)."""
        try:
            return self._admit(request, sender, request_id, arrival_time, on_accept)
        except Exception as exc:  # one request's failure must not fail its batch-mates
            logger.exception("reading a request failed")
            try:
                send_error(self.pb, sender, f"internal error while reading the request: "
                           f"{type(exc).__name__}: {exc}", self.pb.TritonError.INTERNAL)
            except Exception:
                logger.exception("sending an error response failed")
            return None

    def _admit(self, request, sender, request_id: str, arrival_time: float, on_accept: OnAccept) -> ResponseState | None:
        pb = self.pb
        get_input = input_getter(pb, request)
        if get_input("list_lora_adapters") is not None:  # a question, not a generation
            self._answer_adapters(sender, get_input)
            return None
        try:
            parsed = parse_request(get_input, self.inputs.check_sampling_params, self.max_prompt_bytes)
            self.priorities.apply(parsed.sampling_params)
            if parsed.lora_task_id is not None:  # TensorRT-LLM's way of naming the adapter
                parsed.sampling_params.lora_name = self.inputs.resolve_lora(parsed.sampling_params.lora_name,
                                                                            parsed.lora_task_id)
            prompt, add_special_tokens = parsed.prompt, True
            if parsed.messages is not None:
                prompt, add_special_tokens = self.inputs.render_chat(parsed.messages), False
            prompt_token_ids = parsed.prompt_token_ids
            if prompt_token_ids is not None:  # already tokenized: the text only for echo
                self.inputs.check_token_ids("input_ids", prompt_token_ids)
                prompt = self.inputs.tokenizer.decode(prompt_token_ids) if not parsed.exclude_input_in_output else ""
        except (InputError, EngineInputError) as exc:
            send_error(pb, sender, str(exc), pb.TritonError.INVALID_ARG)
            return None
        if prompt_token_ids is None:
            prompt_token_ids = self.inputs.tokenize(prompt, add_special_tokens)
        params = parsed.sampling_params
        state = ResponseState(request_id, parsed.stream, parsed.exclude_input_in_output, prompt, arrival_time,
                              returns=parsed.returns, wants_logprobs=params.logprobs,
                              prompt_token_ids=prompt_token_ids, num_samples=params.n,
                              stream_interval=parsed.stream_interval or self.stream_interval,
                              requested_outputs=requested_outputs(request))
        try:
            self.engine.submit(AddRequest(request_id, prompt_token_ids, params, arrival_time),
                               on_accept=lambda: on_accept(state, sender))
        except BusyError as exc:
            send_error(pb, sender, str(exc), pb.TritonError.UNAVAILABLE)
            return None
        return state

    def _answer_adapters(self, sender, get_input) -> None:
        """``list_lora_adapters``: the adapters this model serves, as JSON in ``text_output``
        ([{"name", "task_id"}], [] without enable_lora): how the OpenAI front lists them as models."""
        pb = self.pb
        try:
            if not as_bool("list_lora_adapters", scalar(get_input, "list_lora_adapters")):
                raise InputError("list_lora_adapters: send true to ask which adapters this model serves")
        except InputError as exc:
            send_error(pb, sender, str(exc), pb.TritonError.INVALID_ARG)
            return
        registry = self.inputs.lora
        entries = [] if registry is None else [{"name": e.name, "task_id": e.task_id} for e in registry.by_name.values()]
        sender.send(build_response(pb, json.dumps(entries), [], "stop"), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
