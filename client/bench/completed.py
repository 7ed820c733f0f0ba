"""One request's result as the load generator records it, and how each runner (threads:
client.bench.runner; coroutines: client.bench.aio_runner) sends a work item and records its end."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from client.bench.progress import Progress
from client.bench.stats import RequestRecord
from client.bench.workload import WorkItem


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    """A request's timing record plus what the server said about it."""

    record: RequestRecord
    finish_reason: str
    expected_output_tokens: int
    expected_input_tokens: int
    text: str = ""


def count_length_mismatches(completed: Sequence[CompletedRequest]) -> int:
    """Successful requests whose input or output token count differs from what the workload asked for."""
    return sum(1 for c in completed if not c.record.error and (
        c.record.num_output_tokens != c.expected_output_tokens or c.record.num_input_tokens != c.expected_input_tokens))


def triton_inputs(item: WorkItem) -> dict:
    """The `llm` inputs a work item is sent with: forced length, or the item's own inputs."""
    return {"max_tokens": item.max_tokens, "stream": True,
            **({"ignore_eos": True} if item.inputs is None else item.inputs)}


def token_counter(progress: Progress):
    """A request's on_response callback: adds the tokens each response brought to ``progress``."""
    seen_tokens = 0

    def on_response(_rid, result) -> None:
        nonlocal seen_tokens
        count = len(result.token_ids) or (result.num_output_tokens or 0)  # or vllm_backend's counts
        progress.add_tokens(count - seen_tokens)
        seen_tokens = count

    return on_response


def failed_request(item: WorkItem, start: float, exc: Exception, progress: Progress) -> CompletedRequest:
    """A request that raised before it could complete (no stream, timeout): an error record."""
    record = RequestRecord(start, time.monotonic(), None, (), 0, item.num_input_tokens,
                           error=f"{type(exc).__name__}: {exc}")
    progress.finish(failed=True)
    return CompletedRequest(record, "", item.max_tokens, item.num_input_tokens)


def completed_request(item: WorkItem, result, progress: Progress) -> CompletedRequest:
    """The record of a request that got its final response (``result``: a client's StreamResult)."""
    error = result.error
    if error is None and result.finish_reason == "abort":
        error = "request aborted by the server"
    num_output = result.num_output_tokens if result.num_output_tokens is not None else len(result.token_ids)
    num_input = result.num_input_tokens if result.num_input_tokens is not None else item.num_input_tokens
    record = RequestRecord(
        start_time=result.start_time, end_time=result.end_time, first_token_time=result.first_token_time,
        token_times=tuple(result.token_times), num_output_tokens=num_output, num_input_tokens=num_input,
        error=error,
    )
    progress.finish(failed=error is not None)
    return CompletedRequest(record, result.finish_reason, item.max_tokens, item.num_input_tokens, result.text)
