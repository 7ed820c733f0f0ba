"""The engine: add requests, abort them, and step; no threads and no Triton.

``LLMEngine`` is the loop; each piece it drives lives in its own module of this package
(docs/architecture.md has the whole map). ``add_request`` checks and tokenizes a request
(backend/engine/input_processor.py), asks the scheduler's ``rejection_reason`` once (prompt size
against max_model_len, the KV pool, the budget) and makes its ``Request`` (backend/engine/request.py),
which from then on holds everything kept for it. Each ``step()``:

1. schedule: the scheduler (backend/engine/scheduler.py) picks this iteration's tokens under one
   budget, running requests first, prompts chunked, the newest preempted when blocks run out; the
   KV manager (backend/kv_cache/manager.py) allocates their slots and reuses cached prefix blocks;
2. run: the model runner (backend/runner/model_runner.py) runs one forward over the flattened
   batch and returns logits for the requests whose chunk reached their last token;
3. sample and update: the output processor (backend/engine/output_processor.py) does everything
   after the forward (sampling, verifying proposals, appending, stop checks, the ``n`` and beam
   fan-out, building outputs); finished requests leave the scheduler and free their blocks.

Triton's glue (backend/triton) drives it from a thread or the engine-core process;
``generate()`` and perf/engine_driver.py drive it offline.
"""

from __future__ import annotations

import logging
import time

import torch

from backend.config import ConfigError, EngineConfig
from backend.engine.cpu_threads import cpu_thread_governor
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.engine_stats import collect_engine_stats
from backend.engine.input_processor import EngineInputError, InputProcessor
from backend.engine.output_processor import OutputProcessor, collect_prompt_logprobs, internal_error_message
from backend.engine.outputs import StepOutput, StepStats
from backend.engine.request import Request
from backend.engine.scheduler import Scheduler
from backend.engine.step_clock import PhaseClock
from backend.engine.tokenizer import load_tokenizer
from backend.kv_cache.event_publisher import publisher_from_config
from backend.kv_cache.manager import KVCacheManager
from backend.kv_cache.offload.from_config import build_offloader
from backend.kv_cache.request_view import RequestBlocks
from backend.kv_transfer.from_config import attach_kv_transfer
from backend.lora.manager import LORA_ARCHITECTURES, LoRAManager, root_hash
from backend.lora.registry import LoRAConfigError
from backend.parallel.driver import WorkerLost
from backend.protocol.outputs import EngineStats, GenerationResult, RequestOutput
from backend.protocol.sampling import SamplingParams
from backend.protocol.structured_output import StructuredOutputError
from backend.runner.model_runner import ModelRunner
from backend.runner.sampler import Sampler
from backend.spec_decode.speculator import Speculator
from backend.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def is_held(request: Request) -> bool:
    """A waiting request the scheduler must step over: its grammar still compiles, or it is a
    preempted beam whose log-probabilities are in (nothing to do before its group's step)."""
    if request.grammar is not None and not request.grammar.ready:
        return True
    return request.is_beam and request.fanout.beam.has_row(request)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (see module docstring)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        """``runner`` defaults to ``ModelRunner.load`` of ``config``; the engine learns its block count.

        Raises ConfigError naming the parameter when the model cannot be served as configured.
        """
        self.config = config
        torch.manual_seed(config.model.seed)
        self.model_runner = runner or ModelRunner.load(config.model, config.cache, config.scheduler.max_num_seqs,
                                                       config.lora)
        self.tokenizer = load_tokenizer(config.model.tokenizer_dir)
        self.max_model_len = config.model.max_model_len
        self.vocab_size = self.model_runner.shape.vocab_size
        self.eos_token_id = self._eos_token_id()
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len,
                                              config.structured_output, config.kv_transfer,  # (lora: see _lora_manager)
                                              default_max_tokens=config.scheduler.default_max_tokens)
        self.num_kv_blocks = self.model_runner.num_kv_blocks
        block_size = self.model_runner.block_size
        self.offloader = build_offloader(config.cache, self.model_runner.kv_caches, block_size, config.model.model_dir)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, block_size, config.cache.enable_prefix_caching,
                                               self.offloader, self.model_runner.model.family.shared_window)
        self.kv_cache_manager.block_io = self.model_runner.block_io  # writes blocks loaded from the tier or a prefill engine
        self.kv_cache_manager.copy_blocks = self.model_runner.copy_blocks  # copy-on-write, on every rank
        # Disaggregated serving (kv_role): a prefill engine's transfer server or a decode engine's puller.
        self.kv_transfer = attach_kv_transfer(config.kv_transfer, self.kv_cache_manager, self.model_runner.kv_caches,
                                              block_size)
        # vLLM-format KV-cache events for a cache-aware router; None unless kv_events_endpoint is set.
        self.kv_event_publisher = publisher_from_config(config.kv_events, self.kv_cache_manager, self.offloader)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.max_model_len, self.kv_cache_manager,
                                   is_held=is_held)
        self.lora = self._lora_manager()  # LoRA adapters (backend/lora); None unless enable_lora
        self.sampler = Sampler(seed=config.model.seed)
        self.speculator = (Speculator(config, self.model_runner, self.sampler, self.max_model_len)
                           if config.speculative.enabled else None)
        self.structured_output = self._structured_output_manager()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.sampler, self.max_model_len,
                                                self.speculator, self.structured_output)
        # The output processor's tables of live requests (engine ids; n > 1 and beam groups by client id).
        self.requests = self.output_processor.requests
        self.groups = self.output_processor.groups
        self.beam_groups = self.output_processor.beam_groups
        self._step_requests: list[Request] | None = None  # scheduled in the running step
        # Fewer torch threads while other processes hold this machine's CPUs; None when fixed.
        self.cpu_threads = cpu_thread_governor(config.model.cpu_adaptive_threads, self.model_runner.device.type,
                                               config.model.tensor_parallel_size)

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.model_runner.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _lora_manager(self):
        """The adapters, attached to the model runner and the scheduler's max_loras; None without
        enable_lora. A bad multi_lora.json fails the engine's start naming the file."""
        if not self.config.lora.enable_lora:
            return None

        runner, scheduler = self.model_runner, self.scheduler
        family = runner.model.family
        if family.architecture not in LORA_ARCHITECTURES:  # adapters name q/k/v/gate/up modules of a dense MLP
            raise ConfigError(f"parameter 'enable_lora': LoRA adapters are served on Llama, Mistral, Qwen2 and Qwen3 "
                              f"checkpoints, not on {family.architecture}")
        live = lambda: {r.sampling_params.lora_name for r in (*scheduler.running, *scheduler.waiting)}  # noqa: E731
        try:
            manager = LoRAManager(self.config.lora, runner.model.full_shape, runner.dtype, runner.device, live,
                                  shard=runner.model.shard, local_shape=runner.shape)
        except LoRAConfigError as exc:
            raise ConfigError(str(exc)) from None
        runner.attach_lora(manager)
        scheduler.max_loras = self.config.lora.max_loras
        self.input_processor.lora = manager.registry
        return manager

    def _structured_output_manager(self):
        """Grammar compiler and matchers (backend/structured_output); None without xgrammar. A compile
        worker that cannot start fails the engine's start (CompileWorkerError), not each request."""
        try:
            return StructuredOutputManager.for_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_id, self.config.scheduler.max_num_seqs,
                self.config.structured_output)
        except ImportError as exc:
            logger.warning("structured output is off: %s", exc)
            return None

    # ----------------------------------------------------------------------------- requests
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template's prompt for ``messages`` (backend/engine/input_processor.py)."""
        return self.input_processor.render_chat(messages)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """The one check of a request's sampling parameters (backend/engine/input_processor.py)."""
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
        if self.output_processor.is_live(request_id):
            raise EngineInputError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        if check:
            self.check_sampling_params(params)
        else:
            self.input_processor.apply_defaults(params)
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
        if params.lora_name is not None:  # the KV record starts from the adapter's root, before the cache sees it
            request.kv = RequestBlocks(hash_root=self._adapter_root(params.lora_name))
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=list(params.stop),
            skip_special_tokens=params.skip_special_tokens,
        )
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise EngineInputError(f"{params.structured_outputs.key}: structured output needs the xgrammar package")
            try:
                self.structured_output.add(request)  # compiles off the step; the request waits for it
            except StructuredOutputError as exc:  # over the budget, or its client's compiles in flight
                raise EngineInputError(str(exc)) from None
        self.output_processor.register(request)
        self.scheduler.add_request(request)
        return request

    def _adapter_root(self, name: str):
        """Loads adapter ``name`` for a request (EngineInputError naming why it cannot be served) and
        returns what its KV blocks chain to (backend/lora/manager.py root_hash)."""
        if self.lora is None:
            raise EngineInputError("lora_name: this model serves no LoRA adapters (parameter enable_lora)")

        try:
            return root_hash(self.lora.require(name))
        except LoRAConfigError as exc:
            raise EngineInputError(str(exc)) from None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (frees its blocks); returns its final output, or None if unknown.

        Any sample of an n > 1 request (or the client's id) ends all of them, with one output."""
        return self.output_processor.abort(request_id)

    def fail_requests(self, request_ids: list[str], message: str, kv_suspect: bool = True) -> list[RequestOutput]:
        """Ends these requests with an error. ``kv_suspect`` (a step failed before or during its
        forward) also forgets cached prefixes: the KV of blocks hashed in that step may never have
        been written. A request that failed after the forward (its sampling, its stop checks)
        leaves the cache as it is, so one bad request does not cost everyone their prefix hits."""
        outputs = self.output_processor.fail(request_ids, message)
        if kv_suspect:
            self.kv_cache_manager.reset_prefix_cache()
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.flush()
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every request with an error (unload, or a step that failed before scheduling)."""
        return self.fail_requests(list(self.requests), message)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def release_transferred(self) -> None:
        """A prefill engine gives back the blocks it kept for pulls that are done or timed out
        (every step does this; a serving loop also calls it when idle)."""
        if self.kv_transfer is not None:
            self.kv_cache_manager.release_transferred()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def stats(self) -> EngineStats:
        return collect_engine_stats(self)

    def close(self) -> None:
        """Shutdown: the grammar compile worker is killed; a disk offload tier also keeps the prefixes
        still cached in the pool, so a restarted server finds them; then the tier's threads stop
        (idempotent)."""
        if self.structured_output is not None:
            self.structured_output.close()
        self.model_runner.close()  # a tensor-parallel group's other ranks
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.flush()
            self.kv_event_publisher.close()
        if self.offloader is None:
            return
        if self.offloader.tier.name == "disk" and not self.offloader.closed:
            pool = self.kv_cache_manager.block_pool
            self.offloader.keep(list(pool.cached_block_hash_to_block.values()))
        self.offloader.close()

    # ----------------------------------------------------------------------------- the step
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
        except WorkerLost:  # no request is to blame and no step can run: whoever drives the engine restarts it
            raise
        except Exception as exc:
            logger.exception("engine step failed")
            message = internal_error_message(exc)
            if self._step_requests is None:
                return StepOutput(self.fail_all(message), StepStats())
            failed = self.fail_requests([r.request_id for r in self._step_requests], message)
            return StepOutput(failed, StepStats(num_seqs=len(self._step_requests)))

    def step(self, timings: bool = False) -> StepOutput:
        """One iteration: schedule, run, sample and update. KV-cache events go out twice: the blocks
        the schedule cached (and evicted) before the forward, what the step freed after it.

        Returns the outputs and the step's statistics; ``timings`` adds seconds per phase
        (schedule, prepare, forward, logits, sample, detokenize).
        """
        try:
            return self._step(timings)
        finally:
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.flush()

    @torch.inference_mode()
    def _step(self, timings: bool) -> StepOutput:
        clock = PhaseClock() if timings else None
        self.release_transferred()
        outputs: list[RequestOutput] = self._take_grammar_failures()
        if self.speculator is not None:
            self._propose()
        scheduler_output = self.scheduler.schedule()
        scheduled = scheduler_output.scheduled
        stats = scheduler_output.step_stats()
        if clock is not None:
            stats.timings = clock.lap({}, "schedule")
        if self.offloader is not None:
            self.offloader.capture()  # blocks evicted by this schedule, before the forward overwrites them
        if self.kv_event_publisher is not None:
            # The blocks this step scheduled are findable by the next schedule already, so a router
            # hears of them now, not after a forward that may take seconds for a long prompt.
            self.kv_event_publisher.flush()
        if not scheduled:
            self._idle()
            return StepOutput(outputs, stats)
        self._step_requests = [item.request for item in scheduled]
        forward_start = time.perf_counter()
        logits, rows = self.model_runner.execute(scheduled, stats.timings)
        self._observe_forward(scheduler_output.num_scheduled_tokens, stats, time.perf_counter() - forward_start)
        if self.cpu_threads is not None:
            self.cpu_threads.observe()
        for index, (first, values) in self.model_runner.prompt_logprobs.items():
            collect_prompt_logprobs(scheduled[index].request, first, values)
        if clock is not None:
            clock.restart()
        if rows:
            outputs.extend(self.output_processor.process(scheduled, logits, rows, stats, clock))
        return StepOutput(outputs, stats)

    def _idle(self) -> None:
        """Nothing was scheduled: wait a little for what the waiting requests wait for, not spin."""
        if self.structured_output is not None and self.structured_output.has_pending:
            self.structured_output.wait()  # only grammars left to wait for
        elif self.kv_cache_manager.has_pending_restores:
            time.sleep(0.002)  # only loads from the tier or a prefill engine left to wait for

    def _observe_forward(self, num_scheduled_tokens: int, stats: StepStats, seconds: float) -> None:
        """The forward's time for the speculation controller's step-time model and the offload
        tier's cost rule, which both follow the machine's load."""
        if self.speculator is not None:
            self.speculator.observe_step(num_scheduled_tokens, seconds)
        if self.offloader is not None:
            self.offloader.observe_step(stats.num_prefill_tokens + stats.num_decode_tokens, stats.num_prefill_tokens,
                                        seconds)

    def _propose(self) -> None:
        """Proposals for this step; a failing proposer costs only the speculation of this step."""
        try:
            self.speculator.propose(self.scheduler.running)
        except Exception:
            logger.exception("proposing speculative tokens failed; this step decodes without them")
            self.speculator.clear(self.scheduler.running)

    def _take_grammar_failures(self) -> list[RequestOutput]:
        """Requests whose constraint failed to compile end with its error; the others become schedulable."""
        if self.structured_output is None or not self.structured_output.has_pending:
            return []
        outputs = []
        for request, message in self.structured_output.poll():
            outputs.extend(self.fail_requests([request.request_id], message, kv_suspect=False))
        return outputs

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
