"""The engine: add requests, abort them, and step; no threads and no Triton.

How a request flows through it. ``check_sampling_params`` is the one check of its sampling
parameters (backend/triton calls it before queueing; ``add_request`` for everyone else).
``add_request`` tokenizes the prompt, asks the scheduler's ``rejection_reason`` once (prompt size
against max_model_len, the KV pool, the budget), and makes the ``Request`` (backend/request.py),
which from then on holds everything kept for it: tokens, progress, its detokenizer, its seeded
generator, its prefix-cache block hashes. Each ``step()``:

1. the scheduler (backend/scheduler.py) picks this iteration's tokens under one budget: running
   requests first, then waiting ones, prompts chunked, the newest preempted when blocks run out;
   the KV manager (backend/kv_cache/manager.py) allocates their slots and reuses cached prefix
   blocks;
2. the model runner (backend/model_runner.py), which owns the model and the KV cache, runs one
   forward over the flattened batch (decodes first) and returns logits for the requests whose
   chunk reached their last token;
3. the sampler (backend/sampler.py) picks one token each; a failing row fails its request alone;
4. each request appends its token, its detokenizer turns it into a safe text delta (holding back
   partial UTF-8 and possible stop strings), and the stop checks run; a finished request leaves
   the scheduler (its blocks are freed) and the engine (and with it all its state).

``step()`` returns the outputs with the step's statistics. Triton's glue (backend/triton) drives
it from a thread; ``generate()`` and perf/engine_driver.py drive it offline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from backend.beam_group import BeamGroup, beam_request_id
from backend.beam_search import BeamSearch
from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.input_processor import EngineInputError, InputProcessor
from backend.kv_cache.manager import KVCacheManager
from backend.kv_cache.offload.block_io import PagedBlockIO
from backend.kv_cache.offload.from_config import build_offloader
from backend.model_runner import ModelRunner
from backend.request import FinishReason, Request, RequestStatus, SamplingParams
from backend.sampler import Sampler, SamplerOutput
from backend.scheduler import Scheduler
from backend.sequence_group import SequenceGroup, sequence_request_id
from backend.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the new text (a delta); on the final output also any held-back text
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[float] | None = None  # of new_token_ids, when the request asked for logprobs
    logprob_ranks: list[int] | None = None  # of new_token_ids (1 = the most likely token)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (token id, logprob) x top_logprobs
    prompt_logprobs: list[float] | None = None  # with prompt_logprobs, on the first output: of prompt tokens 1..n-1
    arrival_time: float = 0.0
    sequence_index: int = 0  # which sample of an n > 1 request (backend/sequence_group.py)
    sequence_finished: bool = False  # this sample's last output (``finished``: the whole request's)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass(slots=True)
class StepStats:
    """What one step did (vLLM returns scheduler statistics with every step, too)."""

    num_seqs: int = 0  # requests scheduled
    num_prefill_tokens: int = 0  # tokens of prompt chunks (and of preempted requests recomputing)
    num_decode_tokens: int = 0  # one per request decoding its next token
    num_preempted: int = 0  # requests preempted to make room (now waiting again)
    num_sampled: int = 0  # requests that got a token
    num_spec_tokens: int = 0  # proposed tokens verified in this step (counted in num_decode_tokens)
    timings: dict[str, float] | None = None  # seconds per phase, when step(timings=True)


@dataclass(slots=True)
class StepOutput:
    outputs: list[RequestOutput]
    stats: StepStats


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks referenced by requests
    num_kv_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    grammar_compiles: int = 0  # structured-output constraints compiled (cache misses)
    grammar_cache_hits: int = 0  # constrained requests whose grammar was compiled (or compiling) already
    grammar_compile_seconds: list[float] = field(default_factory=list)  # compiles finished since the last stats()
    # The KV offload tier (backend/kv_cache/offload/offloader.py: OffloadStats), cumulative:
    kv_shared_blocks: int = 0  # blocks saved by sharing (prefix hits, forked samples): references beyond the first
    kv_offload_stored_blocks: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_restored_blocks: int = 0
    kv_offload_restored_bytes: int = 0
    kv_offload_hits: int = 0  # blocks
    kv_offload_misses: int = 0  # blocks
    kv_offload_recomputed_blocks: int = 0  # in the tier, recomputed by the cost rule's choice
    kv_offload_dropped_blocks: int = 0  # the write queue was full
    kv_offload_load_seconds: list[float] = field(default_factory=list)  # loads finished since the last stats()
    # Speculative decoding (backend/spec_decode/speculator.py: SpecDecodeStats), cumulative:
    spec_decode_num_draft_tokens: int = 0  # proposals verified
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = field(default_factory=list)  # [k]: proposal i accepted
    spec_decode_num_steps: int = 0  # steps with a request that could speculate
    spec_decode_num_speculated_steps: int = 0  # of those, the steps the controller let speculate


@dataclass(slots=True)
class GenerationResult:
    """The whole result of one request from ``generate()``."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # with prompt_logprobs: of prompt tokens 1..n-1
    samples: list[GenerationResult] = field(default_factory=list)  # all n samples (this one first)


def step_stats(scheduler_output) -> StepStats:
    """Token counts of a scheduled step: a decode is one new token after the prompt, the rest is prefill."""
    stats = StepStats(num_seqs=len(scheduler_output.scheduled), num_preempted=len(scheduler_output.preempted))
    for item in scheduler_output.scheduled:
        request = item.request
        if item.spec_token_ids:  # a decode with proposals to verify
            stats.num_decode_tokens += item.num_new_tokens
            stats.num_spec_tokens += len(item.spec_token_ids)
        elif item.num_new_tokens == 1 and request.num_prompt_tokens <= item.num_computed_tokens:
            stats.num_decode_tokens += 1
        else:
            stats.num_prefill_tokens += item.num_new_tokens
    return stats


class _PhaseClock:
    """Seconds between laps, for step(timings=True)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, timings: dict[str, float], name: str) -> dict[str, float]:
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - self._last
        self._last = now
        return timings


def internal_error_message(exc: BaseException) -> str:
    """What a client is told when generation failed on the server's side (the log has the traceback)."""
    return f"internal error during generation: {type(exc).__name__}: {exc}"


def _split_rows(scheduled, rows: list[int]) -> tuple[list[int], list[int], list[tuple[object, int, int]]]:
    """The runner's rows apart: (scheduled index of each one-row request, their row positions,
    [(scheduled item, first row, number of rows)] of requests verifying proposals)."""
    single, positions, verifying = [], [], []
    position = 0
    while position < len(rows):
        index, count = rows[position], 1
        while position + count < len(rows) and rows[position + count] == index:
            count += 1
        if scheduled[index].spec_token_ids:
            verifying.append((scheduled[index], position, count))
        else:
            single.append(index)
            positions.append(position)
        position += count
    return single, positions, verifying


def _collect_prompt_logprobs(request: Request, first: int, values: list[float]) -> None:
    """Appends a chunk's prompt logprobs; positions already held (a preempted request recomputing) are skipped."""
    have = len(request.prompt_logprobs)
    if first <= have < first + len(values):
        request.prompt_logprobs.extend(values[have - first :])


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (see module docstring)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        """``runner`` defaults to ``ModelRunner.load`` of ``config``; the engine learns its block count.

        Raises ConfigError naming the parameter when the model cannot be served as configured.
        """
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.config = config
        torch.manual_seed(config.model.seed)
        self.model_runner = runner or ModelRunner.load(config.model, config.cache, config.scheduler.max_num_seqs)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_dir)
        self.max_model_len = config.model.max_model_len
        self.vocab_size = self.model_runner.shape.vocab_size
        self.eos_token_id = self._eos_token_id()
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len)
        self.num_kv_blocks = self.model_runner.num_kv_blocks
        block_size = self.model_runner.block_size
        self.offloader = build_offloader(config.cache, self.model_runner.kv_caches, block_size, config.model.model_dir)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, block_size, config.cache.enable_prefix_caching,
                                               self.offloader)
        self.kv_cache_manager.copy_blocks = PagedBlockIO(self.model_runner.kv_caches).copy  # copy-on-write
        self.scheduler = Scheduler(config.scheduler, config.cache, self.max_model_len, self.kv_cache_manager)
        self.sampler = Sampler(seed=config.model.seed)
        self.speculator = (Speculator(config, self.model_runner, self.sampler, self.max_model_len)
                           if config.speculative.enabled else None)
        self.structured_output = self._structured_output_manager()
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, SequenceGroup] = {}  # requests with n > 1, by the client's id
        self.beam_groups: dict[str, BeamGroup] = {}  # beam-search requests, by the client's id
        self._step_requests: list[Request] | None = None  # scheduled in the running step

    # ----------------------------------------------------------------------------- set-up helpers
    def _eos_token_id(self) -> int | None:
        eos = getattr(self.model_runner.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _structured_output_manager(self):
        """Grammar compiler and matchers (backend/structured_output); None without xgrammar."""
        try:
            from backend.structured_output.manager import StructuredOutputManager  # noqa: PLC0415

            return StructuredOutputManager.for_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_id, self.config.scheduler.max_num_seqs)
        except ImportError as exc:
            logger.warning("structured output is off: %s", exc)
            return None

    # ----------------------------------------------------------------------------- requests
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template's prompt for ``messages`` (backend/input_processor.py)."""
        return self.input_processor.render_chat(messages)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """The one check of a request's sampling parameters (backend/input_processor.py)."""
        self.input_processor.check_sampling_params(params)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        check: bool = True,
    ) -> Request:
        """Queues a request; raises EngineInputError naming the field when it can never run.

        ``add_special_tokens`` is how the prompt text is tokenized (False for a rendered chat);
        ``check=False`` skips ``check_sampling_params`` for a caller that made it already.
        """
        if request_id in self.requests or request_id in self.groups or request_id in self.beam_groups:
            raise EngineInputError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams(max_tokens=self.config.scheduler.default_max_tokens)
        if check:
            self.check_sampling_params(params)
        if prompt_token_ids is None:
            if prompt is None:
                raise EngineInputError("text_input: a prompt is required")
            prompt_token_ids = self.tokenize(prompt, add_special_tokens)
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise EngineInputError(f"prompt token ids must be in [0, {self.vocab_size})")
        request = Request(
            request_id, list(prompt_token_ids), params, eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        reason = self.scheduler.rejection_reason(request)
        if reason is not None:
            raise EngineInputError(reason)
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=list(params.stop),
            skip_special_tokens=params.skip_special_tokens,
        )
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise EngineInputError(f"{params.structured_outputs.key}: structured output needs the xgrammar package")
            self.structured_output.add(request)  # compiles off the step; the request waits for it
        if params.beam_width > 1:
            eos = () if params.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
            search = BeamSearch(params.beam_width, params.max_tokens, tuple(dict.fromkeys((*eos, *params.stop_token_ids))),
                                params.length_penalty, params.early_stopping)
            beams = [request] + [None] * (params.beam_width - 1)  # the others fork from it at its first token
            request.beam = self.beam_groups[request_id] = BeamGroup(request_id, search, params.n, beams)
        elif params.n > 1:
            request.group = self.groups[request_id] = SequenceGroup(request_id, params.n, [request])
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (frees its blocks); returns its final output, or None if unknown.

        Any sample of an n > 1 request (or the client's id) ends all of them, with one output."""
        request = self.requests.get(request_id)
        beam = self.beam_groups.get(request_id) or (request.beam if request is not None else None)
        if beam is not None:
            return self._end_beam_search(beam, aborted=True)[0] if not beam.finished else None
        group = self.groups.get(request_id) or (request.group if request is not None else None)
        if group is not None:
            return self._abort_group(group)
        if request is None:
            return None
        self.scheduler.abort_request(request)
        return self._final_output(request, [], "")

    def _abort_group(self, group: SequenceGroup) -> RequestOutput:
        first = group.sequences[0]
        for sequence in group.unfinished():
            self.scheduler.abort_request(sequence)
            self.requests.pop(sequence.request_id, None)
        group.finished = True
        self.groups.pop(group.request_id, None)
        output = self._output(first, [], "")
        output.finished = output.sequence_finished = True
        output.finish_reason = FinishReason.ABORT
        return output

    def step_or_fail_all(self, timings: bool = False) -> StepOutput:
        """``step()`` for a serving loop: a failing step ends the requests it involved instead of raising.

        A failure ``step()`` can pin on one request (its sampling or its stop checks) already ended
        only that request inside ``step()``. Anything else (scheduling, the forward pass) cannot be
        pinned on one request: the requests scheduled in that step get their final output with the
        error (requests waiting outside the step keep their place), or every request when the step
        failed before it had scheduled anything. The traceback goes to the log, not to clients.
        """
        self._step_requests = None
        try:
            return self.step(timings)
        except Exception as exc:
            logger.exception("engine step failed")
            message = internal_error_message(exc)
            if self._step_requests is None:
                return StepOutput(self.fail_all(message), StepStats())
            failed = self.fail_requests([r.request_id for r in self._step_requests], message)
            return StepOutput(failed, StepStats(num_seqs=len(self._step_requests)))

    def fail_requests(self, request_ids: list[str], message: str, kv_suspect: bool = True) -> list[RequestOutput]:
        """Ends these requests with an error. ``kv_suspect`` (a step failed before or during its
        forward) also forgets cached prefixes: the KV of blocks hashed in that step may never have
        been written. A request that failed after the forward (its sampling, its stop checks)
        leaves the cache as it is, so one bad request does not cost everyone their prefix hits."""
        outputs = []
        for request_id in request_ids:
            output = self.abort_request(request_id)
            if output is not None:
                output.finish_reason = FinishReason.ERROR
                output.error = message
                outputs.append(output)
        if kv_suspect:
            self.kv_cache_manager.reset_prefix_cache()
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every request with an error (unload, or a step that failed before scheduling)."""
        return self.fail_requests(list(self.requests), message)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def stats(self) -> EngineStats:
        manager = self.kv_cache_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=manager.usage,
            num_kv_blocks=self.num_kv_blocks,
            prefix_cache_queries=manager.prefix_queries,
            prefix_cache_hits=manager.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_shared_blocks=manager.block_pool.num_shared_references,
            **self._grammar_stats(),
            **self._offload_stats(),
            **self._spec_decode_stats(),
        )

    def _spec_decode_stats(self) -> dict:
        if self.speculator is None:
            return {}
        stats = self.speculator.snapshot()
        return {"spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
                "spec_decode_accepted_per_position": stats.accepted_per_position,
                "spec_decode_num_steps": stats.num_steps,
                "spec_decode_num_speculated_steps": stats.num_speculated_steps}

    def _offload_stats(self) -> dict:
        if self.offloader is None:
            return {}
        stats = self.offloader.stats
        return {"kv_offload_stored_blocks": stats.stored_blocks, "kv_offload_stored_bytes": stats.stored_bytes,
                "kv_offload_restored_blocks": stats.restored_blocks, "kv_offload_restored_bytes": stats.restored_bytes,
                "kv_offload_hits": stats.hit_blocks, "kv_offload_misses": stats.miss_blocks,
                "kv_offload_recomputed_blocks": stats.recomputed_blocks,
                "kv_offload_dropped_blocks": stats.dropped_blocks,
                "kv_offload_load_seconds": self.offloader.take_load_seconds()}

    def close(self) -> None:
        """Shutdown: a disk offload tier also keeps the prefixes still cached in the pool, so a
        restarted server finds them; then the tier's threads stop (idempotent)."""
        if self.offloader is None:
            return
        if self.offloader.tier.name == "disk" and not self.offloader.closed:
            pool = self.kv_cache_manager.block_pool
            self.offloader.keep(list(pool.cached_block_hash_to_block.values()))
        self.offloader.close()

    def _grammar_stats(self) -> dict:
        if self.structured_output is None:
            return {}
        compiler = self.structured_output.compiler
        return {"grammar_compiles": compiler.num_compiles, "grammar_cache_hits": compiler.num_cache_hits,
                "grammar_compile_seconds": compiler.take_compile_seconds()}

    # ----------------------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self, timings: bool = False) -> StepOutput:
        """One iteration: schedule, forward, sample, detokenize, stop checks.

        Returns the outputs and the step's statistics; ``timings`` adds seconds per phase
        (schedule, prepare, forward, logits, sample, detokenize).
        """
        clock = _PhaseClock() if timings else None
        outputs: list[RequestOutput] = self._take_grammar_failures()
        if self.speculator is not None:
            self._propose()
        scheduler_output = self.scheduler.schedule()
        scheduled = scheduler_output.scheduled
        stats = step_stats(scheduler_output)
        if clock is not None:
            stats.timings = clock.lap({}, "schedule")
        if self.offloader is not None:
            self.offloader.capture()  # blocks evicted by this schedule, before the forward overwrites them
        if not scheduled:
            if self.structured_output is not None and self.structured_output.has_pending:
                self.structured_output.wait()  # only grammars left to wait for: do not spin
            elif self.kv_cache_manager.has_pending_restores:
                time.sleep(0.002)  # only tier loads left to wait for
            return StepOutput(outputs, stats)
        self._step_requests = [item.request for item in scheduled]
        forward_start = time.perf_counter()
        logits, rows = self.model_runner.execute(scheduled, stats.timings)
        if self.speculator is not None:  # the controller's step-time model follows the machine's load
            self.speculator.observe_step(scheduler_output.num_scheduled_tokens, time.perf_counter() - forward_start)
        if self.offloader is not None:  # the cost rule's prefill rate and step time
            self.offloader.observe_step(stats.num_prefill_tokens + stats.num_decode_tokens, stats.num_prefill_tokens,
                                        time.perf_counter() - forward_start)
        for index, (first, values) in self.model_runner.prompt_logprobs.items():
            _collect_prompt_logprobs(scheduled[index].request, first, values)
        if clock is not None:
            clock.restart()
        if not rows:
            return StepOutput(outputs, stats)
        rows, normal_positions, verifying = _split_rows(scheduled, rows)
        if verifying:
            spec_logits = logits
            logits = logits.index_select(0, torch.tensor(normal_positions, dtype=torch.int64, device=logits.device))
        if rows:
            self._sample_step(logits, [scheduled[i].request for i in rows], outputs, stats, clock)
        if verifying:
            self._verify_step(spec_logits, verifying, outputs, stats)
            if clock is not None:
                clock.lap(stats.timings, "verify")
        return StepOutput(outputs, stats)

    def _propose(self) -> None:
        """Proposals for this step; a failing proposer costs only the speculation of this step."""
        try:
            self.speculator.propose(self.scheduler.running)
        except Exception:
            logger.exception("proposing speculative tokens failed; this step decodes without them")
            for request in self.scheduler.running:
                request.spec_token_ids = []
                request.spec_draft_probs = None

    def _sample_step(self, logits: torch.Tensor, sampling_requests: list[Request], outputs: list[RequestOutput],
                     stats: StepStats, clock: _PhaseClock | None) -> None:
        """One token for each row (forks, beams, grammars, the sampler), appended with the stop checks.
        logits: [len(sampling_requests), vocab_size]."""
        stats.num_sampled += len(sampling_requests)
        logits = self._fork_samples(logits, sampling_requests)
        if any(r.beam is not None for r in sampling_requests):  # beams are scored, not sampled
            outputs.extend(self._beam_steps(logits, sampling_requests))
            keep = [i for i, r in enumerate(sampling_requests) if r.beam is None]
            sampling_requests = [sampling_requests[i] for i in keep]
            logits = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
            if not sampling_requests:
                return
        if self.structured_output is not None and self.structured_output.apply_masks(logits, sampling_requests):
            if clock is not None:
                clock.lap(stats.timings, "grammar")  # only in steps with constrained requests
        sampled, errors = self._sample(logits, sampling_requests)
        if clock is not None:
            clock.lap(stats.timings, "sample")
        now = time.monotonic()
        for index, request in enumerate(sampling_requests):
            error = errors.get(index)
            if error is None:
                try:
                    outputs.append(self._advance(request, sampled, index, now))
                    continue
                except Exception as exc:  # detokenizing or stop checks of this request alone
                    logger.exception("finishing the step of %s failed", request.request_id)
                    error = internal_error_message(exc)
            outputs.extend(self.fail_requests([request.request_id], error, kv_suspect=False))
        if clock is not None:
            clock.lap(stats.timings, "detokenize")

    def _verify_step(self, logits: torch.Tensor, verifying: list[tuple[object, int, int]],
                     outputs: list[RequestOutput], stats: StepStats) -> None:
        """Requests that carried proposals: the verified run of tokens each (backend/spec_decode).
        logits: [all sampling rows, vocab_size]; verifying: (scheduled item, first row, rows)."""
        now = time.monotonic()
        for item, first, count in verifying:
            request = item.request
            try:
                tokens = self.speculator.verify(request, item.spec_token_ids, logits[first : first + count])
                outputs.append(self._advance_tokens(request, tokens, now))
                stats.num_sampled += 1
            except Exception as exc:  # this request alone
                logger.exception("verifying the proposals of %s failed", request.request_id)
                outputs.extend(self.fail_requests([request.request_id], internal_error_message(exc), kv_suspect=False))

    def _advance_tokens(self, request: Request, tokens: list[int], now: float) -> RequestOutput:
        """Appends a verified run of tokens one at a time, each with the stop checks one sampled
        token gets, so the request ends exactly where it would without speculation; then rolls
        back the KV of the positions past what was kept (rejected proposals)."""
        if request.first_token_time is None:
            request.first_token_time = now
        detokenizer = request.detokenizer
        text = ""
        for count, token_id in enumerate(tokens, start=1):
            request.append_output_token(token_id)
            text += detokenizer.update([token_id])
            reason = self._stop_reason(request, token_id, detokenizer)
            if reason is not None:
                status = RequestStatus.FINISHED_LENGTH if reason is FinishReason.LENGTH else RequestStatus.FINISHED_STOPPED
                self.scheduler.finish_request(request, status, reason)
                return self._final_output(request, tokens[:count], text)
        request.num_computed_tokens = request.num_tokens - 1  # the last token's KV comes with the next step
        self.kv_cache_manager.trim(request, request.num_tokens)
        return self._output(request, list(tokens), text)

    def _fork_samples(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Samples 1..n-1 of each n > 1 request whose prompt this step completed fork from sample 0
        (its blocks shared, backend/sequence_group.py) and join ``requests``, each with a copy of
        sample 0's logits row. logits: [num_rows, vocab_size]; returns [num_rows + forks, vocab_size]."""
        extra_rows: list[int] = []
        for row in range(len(requests)):
            parent = requests[row]
            group = parent.group
            if group is None or group.forked or parent.sequence_index != 0 or parent.num_output_tokens:
                continue
            group.forked = True
            params = parent.sampling_params
            for index in range(1, group.n):
                child_params = dataclasses.replace(
                    params, n=1, prompt_logprobs=None, seed=None if params.seed is None else (params.seed + index) % 2**64)
                child = Request(sequence_request_id(group.request_id, index), list(parent.prompt_token_ids),
                                child_params, eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time)
                child.group, child.sequence_index = group, index
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids,
                                                           stop=list(params.stop),
                                                           skip_special_tokens=params.skip_special_tokens)
                child.status = RequestStatus.RUNNING
                child.first_scheduled_time, child.num_cached_tokens = parent.first_scheduled_time, parent.num_cached_tokens
                self.kv_cache_manager.fork(parent, child)
                self.scheduler.running.append(child)
                self.requests[child.request_id] = child
                group.sequences.append(child)
                requests.append(child)
                extra_rows.append(row)
        if not extra_rows:
            return logits
        return torch.cat([logits, logits.index_select(0, torch.tensor(extra_rows, device=logits.device))])

    # ----------------------------------------------------------------------------- beam search
    def _beam_steps(self, logits: torch.Tensor, requests: list[Request]) -> list[RequestOutput]:
        """Keeps each beam's log-probabilities; runs the step of every group whose beams are all
        in (backend/beam_group.py). logits: [num_rows, vocab_size]."""
        touched: dict[str, BeamGroup] = {}
        for row, request in enumerate(requests):
            group = request.beam
            if group is None or group.finished:
                continue
            group.rows[group.beams.index(request)] = torch.log_softmax(logits[row].float(), dim=-1).cpu()
            touched[group.request_id] = group
        outputs: list[RequestOutput] = []
        for group in touched.values():
            if group.ready():
                outputs.extend(self._beam_step(group))
        return outputs

    def _beam_step(self, group: BeamGroup) -> list[RequestOutput]:
        decided = group.search.step(group.log_probs())
        group.rows.clear()
        if decided.done:
            return self._end_beam_search(group)
        old = group.beams
        new: list[Request] = []
        taken: set[int] = set()
        for parent_index in decided.parents:  # forks first: a parent takes its own token after
            parent = old[parent_index] if old[parent_index] is not None else old[0]  # not forked yet: beam 0's copy
            if parent_index not in taken and old[parent_index] is not None:
                taken.add(parent_index)
                new.append(parent)
                continue
            new.append(self._fork_beam(group, parent))
        for index, request in enumerate(old):
            if request is not None and index not in taken:  # no new beam continues it
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
                self.requests.pop(request.request_id, None)
        for request, token in zip(new, decided.tokens, strict=True):
            request.append_output_token(token)
        group.beams = new
        return []

    def _fork_beam(self, group: BeamGroup, parent: Request) -> Request:
        child = Request(beam_request_id(group.request_id, group.num_created), list(parent.prompt_token_ids),
                        parent.sampling_params, eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time)
        group.num_created += 1
        child.all_token_ids = list(parent.all_token_ids)
        child.beam = group
        child.first_scheduled_time, child.num_cached_tokens = parent.first_scheduled_time, parent.num_cached_tokens
        if parent.status == RequestStatus.RUNNING:
            child.status = RequestStatus.RUNNING
            self.kv_cache_manager.fork(parent, child)
            self.scheduler.running.append(child)
        else:  # a preempted parent (its row was kept): the child recomputes, as the parent will
            self.scheduler.add_request(child)
        self.requests[child.request_id] = child
        return child

    def _end_beam_search(self, group: BeamGroup, aborted: bool = False) -> list[RequestOutput]:
        """Frees every running beam; the best n hypotheses (or one abort output) as the request's outputs."""
        group.finished = True
        self.beam_groups.pop(group.request_id, None)
        first = next(b for b in group.beams if b is not None)
        for request in group.beams:
            if request is None:
                continue
            if aborted:
                self.scheduler.abort_request(request)
            else:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
            self.requests.pop(request.request_id, None)
        now = time.monotonic()
        base = dict(num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                    arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time)
        if aborted:
            return [RequestOutput(group.request_id, [], "", True, FinishReason.ABORT, num_output_tokens=0,
                                  sequence_finished=True, **base)]
        params = first.sampling_params
        outputs = []
        hypotheses = group.search.best(group.n)
        for index, (tokens, _score) in enumerate(hypotheses):
            reason = FinishReason.EOS if tokens and tokens[-1] in group.search.eos_token_ids else FinishReason.LENGTH
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            outputs.append(RequestOutput(group.request_id, tokens, text, index == len(hypotheses) - 1, reason,
                                         num_output_tokens=len(tokens), sequence_index=index, sequence_finished=True,
                                         first_token_time=now, **base))
        return outputs

    def _take_grammar_failures(self) -> list[RequestOutput]:
        """Requests whose constraint failed to compile end with its error; the others become schedulable."""
        if self.structured_output is None or not self.structured_output.has_pending:
            return []
        outputs = []
        for request, message in self.structured_output.poll():
            outputs.extend(self.fail_requests([request.request_id], message, kv_suspect=False))
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[SamplerOutput, dict[int, str]]:
        """The sampler over all rows; if that fails, row by row, so a bad row fails its request alone.

        logits: [num_rows, vocab_size]. Returns the sampled rows and {row: error message}. The
        fallback keeps seeded outputs: the sampler draws its random numbers last, after every
        per-row check that can fail.
        """
        try:
            return self.sampler(logits, requests), {}
        except Exception:
            logger.exception("sampling the batch failed; sampling row by row")
        merged = SamplerOutput(token_ids=[0] * len(requests), logprobs=[0.0] * len(requests),
                               ranks=[0] * len(requests), top_logprobs=[[] for _ in requests])
        errors: dict[int, str] = {}
        for index, request in enumerate(requests):
            try:
                row = self.sampler(logits[index : index + 1], [request])
            except Exception as exc:
                logger.exception("sampling %s failed", request.request_id)
                errors[index] = internal_error_message(exc)
                continue
            merged.token_ids[index] = row.token_ids[0]
            if row.logprobs is not None:
                merged.logprobs[index] = row.logprobs[0]
                merged.ranks[index] = row.ranks[0]
                if row.top_logprobs is not None:
                    merged.top_logprobs[index] = row.top_logprobs[0]
        return merged, errors

    def _advance(self, request: Request, sampled: SamplerOutput, index: int, now: float) -> RequestOutput:
        """Appends one sampled token to a request, detokenizes it and applies the stop checks."""
        token_id = sampled.token_ids[index]
        if request.grammar is not None:
            self.structured_output.accept(request, token_id)  # raises (failing it alone) if refused
        request.append_output_token(token_id)
        if sampled.logprobs is not None and request.sampling_params.logprobs:
            request.output_logprobs.append(sampled.logprobs[index])
            request.output_logprob_ranks.append(sampled.ranks[index])
            request.output_top_logprobs.append(sampled.top_logprobs[index] if sampled.top_logprobs else [])
        if request.first_token_time is None:
            request.first_token_time = now
        detokenizer = request.detokenizer
        text = detokenizer.update([token_id])
        reason = self._stop_reason(request, token_id, detokenizer)
        if reason is None:
            return self._output(request, [token_id], text)
        status = RequestStatus.FINISHED_LENGTH if reason is FinishReason.LENGTH else RequestStatus.FINISHED_STOPPED
        self.scheduler.finish_request(request, status, reason)
        return self._final_output(request, [token_id], text)

    def _stop_reason(self, request: Request, token_id: int, detokenizer: IncrementalDetokenizer) -> FinishReason | None:
        params = request.sampling_params
        if detokenizer.stop_matched is not None:
            return FinishReason.STOP
        if request.grammar is not None and request.grammar.terminated:
            return FinishReason.STOP  # the grammar accepted the EOS: the constrained output is complete
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return FinishReason.EOS
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, request: Request, new_token_ids: list[int], text: str) -> RequestOutput:
        logprobs = ranks = top = None
        if request.sampling_params.logprobs and new_token_ids:
            logprobs = request.output_logprobs[-len(new_token_ids):]
            ranks = request.output_logprob_ranks[-len(new_token_ids):]
            top = request.output_top_logprobs[-len(new_token_ids):]
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent and new_token_ids:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        group = request.group
        return RequestOutput(
            request_id=request.request_id if group is None else group.request_id,
            sequence_index=request.sequence_index,
            new_token_ids=new_token_ids,
            text=text,
            finished=False,
            finish_reason=None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=logprobs,
            logprob_ranks=ranks,
            top_logprobs=top,
            prompt_logprobs=prompt_logprobs,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
        )

    def _final_output(self, request: Request, new_token_ids: list[int], text: str) -> RequestOutput:
        """The request's last output: flushes held-back text and forgets the request."""
        if request.detokenizer is not None and request.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
            text += request.detokenizer.finish()
        self.requests.pop(request.request_id, None)  # and with it its detokenizer and generator
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        if request.grammar is not None:
            self.structured_output.release(request)
        output = self._output(request, new_token_ids, text)
        output.finished = output.sequence_finished = True
        output.finish_reason = request.finish_reason
        output.error = request.error
        group = request.group
        if group is not None:  # the request ends with its last sample
            group.num_finished += 1
            output.finished = group.finished = group.num_finished == group.n
            if group.finished:
                self.groups.pop(group.request_id, None)
        return output

    # ----------------------------------------------------------------------------- offline use
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Runs prompts (text or token ids) to completion together; results in prompt order.

        A request with n > 1 returns its first sample, with all n (in order) in ``samples``."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        samples: dict[tuple[str, int], GenerationResult] = {}
        order = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            request_id = f"generate-{index}-{time.monotonic_ns()}"
            if isinstance(prompt, str):
                request = self.add_request(request_id, prompt=prompt, sampling_params=params)
            else:
                request = self.add_request(request_id, prompt_token_ids=list(prompt), sampling_params=params)
            order.append(request_id)
            results[request_id] = GenerationResult(request_id, list(request.prompt_token_ids), [], "", None)
            result = results[request_id]
            for index in range(request.sampling_params.n):
                samples[(request_id, index)] = result if index == 0 else GenerationResult(
                    request_id, list(request.prompt_token_ids), [], "", None)
                result.samples.append(samples[(request_id, index)])
        while self.has_unfinished_requests():
            for output in self.step().outputs:
                result = samples.get((output.request_id, output.sequence_index))
                if result is None:
                    continue
                result.output_token_ids.extend(output.new_token_ids)
                result.text += output.text
                if output.logprobs:
                    result.logprobs.extend(output.logprobs)
                if output.prompt_logprobs is not None:
                    result.prompt_logprobs = output.prompt_logprobs
                if output.sequence_finished:
                    result.finish_reason = output.finish_reason
                    result.error = output.error
                if output.finished and output.error is not None:  # an error or abort ends every sample
                    for sample in results[output.request_id].samples:
                        sample.finish_reason = sample.finish_reason or output.finish_reason
                        sample.error = sample.error or output.error
        return [results[request_id] for request_id in order]
