"""Runs a JSONL batch file through the `llm` model: bounded concurrency, resumable, one result per line.

Resuming: the output file is the record of what is done. Before sending anything the runner reads
it (a half-written last line, from a run killed mid-write, is cut off) and skips every input line
whose key is there: its ``custom_id``, or ``line N`` for a line without a usable one (missing, or a
duplicate of an earlier line's). Each result is appended and flushed as it arrives, so a run killed
at any moment loses only the requests in flight, and the rerun sends exactly those and the unsent
ones: every key ends up in the output once.

Workers: ``concurrency`` threads, each with its own gRPC stream and one request at a time (a
stream's error carries no request id in tritonclient, so one request per stream keeps errors
attributable). "server busy" refusals are retried with backoff; a line that still fails, a
post-processing check that rejects it, or a line that cannot be parsed is recorded with its error
and the run goes on.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

from client.batch.openai_format import (
    BatchRequest,
    LineError,
    error_line,
    output_text,
    parse_line,
    success_line,
)
from client.bench.progress import Progress
from client.stream import StreamingClient

BUSY_RETRIES = 8
BUSY_BACKOFF_SECONDS = 0.5

# A post-processing check: (the request, its generated text) -> None, or (error code, message).
Check = Callable[[BatchRequest, str], "tuple[str, str] | None"]


@dataclass(slots=True)
class Summary:
    input_lines: int = 0
    already_done: int = 0  # keys found in the output before this run
    sent: int = 0
    succeeded: int = 0
    failed: int = 0  # this run, every kind
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: collections.Counter = field(default_factory=collections.Counter)  # code -> lines, this run

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"input_lines": self.input_lines, "already_done": self.already_done, "sent": self.sent,
                "succeeded": self.succeeded, "failed": self.failed, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "seconds": round(self.seconds, 3),
                "completion_tokens_per_s": round(self.tokens_per_s, 2), "errors": dict(self.errors)}

    def table(self) -> str:
        rows = [("input lines", self.input_lines), ("already in the output", self.already_done),
                ("sent this run", self.sent), ("succeeded", self.succeeded), ("failed", self.failed),
                ("prompt tokens", self.prompt_tokens), ("completion tokens", self.completion_tokens),
                ("seconds", f"{self.seconds:.1f}"), ("completion tokens/s", f"{self.tokens_per_s:.1f}")]
        rows += [(f"errors: {code}", count) for code, count in sorted(self.errors.items())]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ----------------------------------------------------------------------------------------- checks
def validate_json(request: BatchRequest, text: str) -> tuple[str, str] | None:
    """The output parses as JSON and, when the request gave a schema, validates against it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return "invalid_json_output", f"the output is not JSON ({exc.msg} at position {exc.pos})"
    if request.schema is not None:
        try:
            jsonschema.validate(value, request.schema, format_checker=jsonschema.FormatChecker())
        except jsonschema.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            return "schema_mismatch", f"the output does not match the schema at {path}: {exc.message}"
    return None


def load_check(spec: str) -> Check:
    """``module:function`` (--post-process): the function takes (request, text), returns None or (code, message)."""
    module_name, _, function_name = spec.partition(":")
    if not function_name:
        raise ValueError(f"--post-process: expected MODULE:FUNCTION, got {spec!r}")
    return getattr(importlib.import_module(module_name), function_name)


# ----------------------------------------------------------------------------------------- resume
def line_key(line: dict) -> str:
    return f"line {line['line']}" if "line" in line else line["custom_id"]


def read_done(output_path: Path) -> dict[str, dict]:
    """Output lines by key; a partial last line (a run killed mid-write) is cut off the file."""
    if not output_path.exists():
        return {}
    data = output_path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(output_path, "r+b") as handle:
            handle.truncate(end)
    done = {}
    for raw in data[:end].splitlines():
        if raw.strip():
            line = json.loads(raw)
            done[line_key(line)] = line
    return done


# ----------------------------------------------------------------------------------------- the run
class BatchRunner:
    def __init__(self, url: str, model: str = "llm", concurrency: int = 64, timeout: float = 600.0,
                 checks: list[Check] | None = None, progress_interval: float = 5.0, priority: int = 0):
        """``priority``: sent with every request that does not set its own (lower runs first; it takes
        effect where the model's scheduling_policy is priority)."""
        self.priority = priority
        self.url = url
        self.model = model
        self.concurrency = concurrency
        self.timeout = timeout
        self.checks = list(checks or [])
        self.progress_interval = progress_interval
        self._write_lock = threading.Lock()

    def run(self, input_path: Path, output_path: Path, order: str = "completion") -> Summary:
        summary = Summary()
        done = read_done(output_path)
        requests, line_errors, order_keys = self._read_input(input_path, summary)
        summary.already_done = sum(1 for key in order_keys if key in done)
        started = time.monotonic()
        with open(output_path, "a", encoding="utf-8") as out:
            for key, line in line_errors:
                if key not in done:
                    self._write(out, line, summary)
            pending = [r for r in requests if r.custom_id not in done]
            summary.sent = len(pending)
            with Progress("batch", len(pending), self.progress_interval, eta=True) as progress:
                self._send_all(pending, out, summary, progress)
        summary.seconds = time.monotonic() - started
        if order == "input":
            rewrite_in_order(output_path, order_keys)
        return summary

    def _read_input(self, input_path: Path, summary: Summary):
        requests: list[BatchRequest] = []
        line_errors: list[tuple[str, dict]] = []
        order_keys: list[str] = []
        seen: set[str] = set()
        with open(input_path, encoding="utf-8") as handle:
            for number, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                summary.input_lines += 1
                try:
                    request = parse_line(number, text)
                except LineError as exc:
                    custom_id = _custom_id_of(text)
                    keyed = custom_id is None or custom_id in seen
                    line = error_line(custom_id, exc.code, str(exc), number if keyed else None)
                    key = line_key(line)
                    if not keyed:
                        seen.add(custom_id)
                    line_errors.append((key, line))
                    order_keys.append(key)
                    continue
                if request.custom_id in seen:
                    line = error_line(request.custom_id, "duplicate_custom_id",
                                      f"line {number}: custom_id {request.custom_id!r} is used by an earlier line",
                                      number)
                    line_errors.append((line_key(line), line))
                    order_keys.append(line_key(line))
                    continue
                seen.add(request.custom_id)
                requests.append(request)
                order_keys.append(request.custom_id)
        return requests, line_errors, order_keys

    def _send_all(self, pending: list[BatchRequest], out, summary: Summary, progress: Progress) -> None:
        work: queue.SimpleQueue = queue.SimpleQueue()
        for request in pending:
            work.put(request)
        threads = [threading.Thread(target=self._worker, args=(work, out, summary, progress), daemon=True,
                                    name=f"batch-worker-{i}") for i in range(min(self.concurrency, len(pending)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _worker(self, work: queue.SimpleQueue, out, summary: Summary, progress: Progress) -> None:
        client = None
        try:
            while True:
                try:
                    request = work.get_nowait()
                except queue.Empty:
                    return
                if client is None:
                    client = StreamingClient(self.url, model_name=self.model)
                line, client = self._one(client, request)
                self._write(out, line, summary)
                if line["error"] is None:
                    progress.add_tokens(line["response"]["body"]["usage"]["completion_tokens"])
                progress.finish(failed=line["error"] is not None)
        finally:
            if client is not None:
                client.close(cancel_requests=True)

    def _one(self, client: StreamingClient, request: BatchRequest) -> tuple[dict, StreamingClient | None]:
        """The output line of one request, and the client to go on with (None: make a new one)."""
        if self.priority:
            request.options["sampling_parameters"].setdefault("priority", self.priority)
        for attempt in range(BUSY_RETRIES + 1):
            request_id = f"{request.custom_id}-{os.getpid()}-{time.monotonic_ns()}"
            try:
                result = client.generate(request.prompt, timeout=self.timeout, request_id=request_id,
                                         **request.options)
            except TimeoutError as exc:
                client.close(cancel_requests=True)
                return error_line(request.custom_id, "timeout", str(exc)), None
            except Exception as exc:  # the stream broke (server gone): this line fails, a new stream goes on
                try:
                    client.close(cancel_requests=True)
                except Exception:  # noqa: S110 (already broken)
                    pass
                return error_line(request.custom_id, "connection", f"{type(exc).__name__}: {exc}"), None
            if result.error is None:
                break
            if "server busy" in result.error and attempt < BUSY_RETRIES:
                time.sleep(BUSY_BACKOFF_SECONDS * 2 ** min(attempt, 4))
                continue
            code = "server_busy" if "server busy" in result.error else "request_rejected"
            return error_line(request.custom_id, code, result.error), client
        line = success_line(request, result, request.body_model or self.model, request_id)
        text = output_text(line) or ""
        for check in self.checks:
            problem = check(request, text)
            if problem is not None:
                code, message = problem
                return error_line(request.custom_id, code, message, response=line["response"]), client
        return line, client

    def _write(self, out, line: dict, summary: Summary) -> None:
        with self._write_lock:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            if line["error"] is None:
                summary.succeeded += 1
                usage = line["response"]["body"]["usage"]
                summary.prompt_tokens += usage["prompt_tokens"]
                summary.completion_tokens += usage["completion_tokens"]
            else:
                summary.failed += 1
                summary.errors[line["error"]["code"]] += 1


def _custom_id_of(text: str) -> str | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def rewrite_in_order(output_path: Path, order_keys: list[str]) -> None:
    """The output sorted in input order (lines of keys not in the input, if any, last)."""
    done = read_done(output_path)
    position = {key: index for index, key in enumerate(order_keys)}
    lines = sorted(done.items(), key=lambda item: position.get(item[0], len(position)))
    partial = output_path.with_suffix(output_path.suffix + ".sorting")
    with open(partial, "w", encoding="utf-8") as handle:
        for _, line in lines:
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(partial, output_path)
