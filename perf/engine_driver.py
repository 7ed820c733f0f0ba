"""The one in-process engine driver: adds requests to an LLMEngine, steps it, and files what every
request got (token ids per sample, and when each token came) at the caller's clock.

Two ways in:

* ``run(engine, requests, pattern)``: the requests arrive as a client.bench ``ArrivalPattern`` says
  (closed-loop concurrency N keeps N in the engine; open-loop rate/burst patterns add each request
  once its send offset has passed), times on the wall clock taken right after each step.
  perf.compare's engine systems, perf.spec_decode, perf.kv_offload, perf.parallel_sampling and
  perf.dtype_choice's agreement check run this.
* ``EngineDriver`` alone, when the caller owns the clock and the arrivals (perf.ablations steps two
  engines in turn, each on its own accumulated step time; perf.profile_step times single steps):
  ``add``, ``step``, then ``record(outputs, now)``.

A request is (prompt token ids, what to generate): an int is a forced length (``max_tokens`` with
``ignore_eos``, what throughput benchmarks want), or any ``SamplingParams``.
Workloads come from client.bench.workload (``prompt_builder`` below gives its builder for an engine's
tokenizer), the same generator the served benchmarks use.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backend.engine.outputs import StepOutput
from backend.paths import REPO_ROOT
from backend.protocol.outputs import RequestOutput
from backend.protocol.sampling import SamplingParams
from client.bench.arrivals import ArrivalPattern, send_offsets
from client.bench.lengths import parse_length
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.stats import RequestRecord
from client.bench.workload import SharedPrefix, build_workload, token_requests

Generation = int | SamplingParams  # a forced output length, or the request's own parameters


def sampling_params(generation: Generation) -> SamplingParams:
    if isinstance(generation, SamplingParams):
        return generation
    return SamplingParams(max_tokens=generation, ignore_eos=True)


def add_model_folder_argument(parser) -> None:
    """--model-folder: the folder whose config.pbtxt configures the engine (default: the `llm` model's)."""
    parser.add_argument("--model-folder", default=str(REPO_ROOT / "model_repository" / "llm"),
                        help="a model folder whose config.pbtxt configures the engine (default: %(default)s)")


def prompt_builder(config) -> PromptBuilder:
    """client.bench's prompt builder on the tokenizer an ``EngineConfig`` loads."""
    return PromptBuilder(config.model.tokenizer_dir or config.model.model_dir)


def token_workload(builder: PromptBuilder, num_requests: int, input_len: str, output_len: str, seed: int,
                   shared_prefix: SharedPrefix | None = None,
                   max_model_len: int | None = None) -> list[tuple[list[int], int]]:
    """client.bench's workload (lengths as its --input-len/--output-len specs) as (token ids, forced
    output length) requests."""
    items = build_workload(builder, num_requests, parse_length(input_len), parse_length(output_len), seed,
                           shared_prefix, max_model_len)
    return token_requests(builder, items)


def warm_up(engine, prompt_token_ids: list[int], max_tokens: int = 2) -> None:
    """One short untimed request (first-call allocations), then the prefix cache forgotten so its
    blocks cannot be hit by what is measured next."""
    engine.generate([list(prompt_token_ids)], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])
    engine.kv_cache_manager.reset_prefix_cache()


@dataclass(slots=True)
class DriverRecord:
    """One request as a client would see it (times in the caller's clock)."""

    arrival: float
    num_input_tokens: int
    arrival_cpu: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per token, at the step that made it
    token_cpu_times: list[float] = field(default_factory=list)
    sample_token_ids: list[list[int]] = field(default_factory=list)  # per sample (sequence_index), in order
    num_output_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    end_time: float | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """The first (for n = 1 the only) sample's tokens."""
        return self.sample_token_ids[0] if self.sample_token_ids else []

    @property
    def ttft(self) -> float | None:
        first = self.first_token_time
        return None if first is None else first - self.arrival

    def request_record(self) -> RequestRecord:
        """client.bench's record of this request, for its statistics."""
        end = self.end_time if self.end_time is not None else self.arrival
        return RequestRecord(self.arrival, end, self.first_token_time, tuple(self.token_times),
                             self.num_output_tokens, self.num_input_tokens, error=self.error)


class EngineDriver:
    """Feeds an LLMEngine requests keyed by any hashable (their engine id is ``f"{label}-{key}"``)."""

    def __init__(self, engine, label: str = "r"):
        self.engine = engine
        self.label = label
        self.records: dict = {}
        self.in_flight = 0
        self.steps = 0
        self.num_tokens = 0

    def add(self, key, prompt_token_ids: list[int], generation: Generation, arrival: float,
            arrival_cpu: float | None = None) -> None:
        self.engine.add_request(self._id(key), prompt_token_ids=list(prompt_token_ids),
                                sampling_params=sampling_params(generation))
        self.records[key] = DriverRecord(arrival, len(prompt_token_ids), arrival_cpu)
        self.in_flight += 1

    def step(self, timings: bool = False) -> StepOutput:
        self.steps += 1
        return self.engine.step(timings)

    def record(self, outputs: list[RequestOutput], now: float, cpu_now: float | None = None) -> list:
        """Files one step's outputs at time ``now``; returns the keys that finished."""
        finished = []
        for output in outputs:
            key = self._key(output.request_id)
            record = self.records[key]
            count = len(output.new_token_ids)
            record.token_times.extend([now] * count)
            if cpu_now is not None:
                record.token_cpu_times.extend([cpu_now] * count)
            while len(record.sample_token_ids) <= output.sequence_index:
                record.sample_token_ids.append([])
            record.sample_token_ids[output.sequence_index].extend(output.new_token_ids)
            record.num_output_tokens = output.num_output_tokens
            self.num_tokens += count
            if output.finished:
                record.finish_reason = str(output.finish_reason)
                record.num_cached_tokens = output.num_cached_tokens
                record.error = output.error
                record.end_time = now
                self.in_flight -= 1
                finished.append(key)
        return finished

    def abort(self, key, reason: str = "abort (run stopped)") -> None:
        self.engine.abort_request(self._id(key))
        record = self.records[key]
        if record.finish_reason is None:
            record.finish_reason = reason
            self.in_flight -= 1

    def _id(self, key) -> str:
        return f"{self.label}-{key}"

    def _key(self, request_id: str):
        raw = request_id[len(self.label) + 1:]
        return int(raw) if raw.isdigit() else raw


@dataclass(slots=True)
class Run:
    """What ``run`` measured: every request's record (in request order), wall and CPU seconds."""

    driver: EngineDriver
    records: list[DriverRecord]
    duration_s: float  # from the first arrival to the last token
    cpu_s: float  # CPU seconds of this process over the same span


def run(engine, requests: Sequence[tuple[list[int], Generation]], pattern: ArrivalPattern | None = None,
        seed: int = 0, progress: Progress | None = None, on_step: Callable[[StepOutput], None] | None = None,
        label: str = "r") -> Run:
    """Runs ``requests`` through ``engine`` until each one ended, arriving as ``pattern`` says
    (default: all at once; ``seed`` seeds open-loop schedules). ``on_step`` sees every step's output."""
    pattern = pattern or ArrivalPattern("concurrency", max(1, len(requests)))
    offsets = send_offsets(pattern, len(requests), seed)
    limit = int(pattern.value) if offsets is None else len(requests)
    pending = deque(range(len(requests)))
    driver = EngineDriver(engine, label)
    start, cpu_start = time.monotonic(), time.process_time()
    while pending or driver.in_flight:
        now = time.monotonic()
        while pending and driver.in_flight < limit and (offsets is None or start + offsets[pending[0]] <= now):
            index = pending.popleft()
            prompt, generation = requests[index]
            driver.add(index, prompt, generation, arrival=now)
        if not driver.in_flight:  # open loop, engine idle: wait for the next arrival
            time.sleep(max(0.0, start + offsets[pending[0]] - time.monotonic()))
            continue
        step = driver.step()
        if on_step is not None:
            on_step(step)
        tokens_before = driver.num_tokens
        for index in driver.record(step.outputs, time.monotonic()):
            if progress is not None:
                progress.finish(failed=driver.records[index].error is not None)
        if progress is not None:
            progress.add_tokens(driver.num_tokens - tokens_before)
    duration, cpu_s = time.monotonic() - start, time.process_time() - cpu_start
    return Run(driver, [driver.records[i] for i in range(len(requests))], duration, cpu_s)
