"""The scheduler: which tokens of which requests run in the next step (vLLM v1 semantics).

There are no prefill or decode phases. Each request has ``num_computed_tokens`` out of
``num_tokens`` (prompt + outputs so far); a step gives each scheduled request
``num_new_tokens = num_tokens - num_computed_tokens`` tokens, capped by one token budget
(``max_num_batched_tokens``) shared by all requests, and at most ``max_num_seqs`` requests run.
A long prompt is therefore chunked over several steps (chunked prefill) and a decode is one token.

Order: running requests first, in admission order; when the pool runs out of blocks the newest
running request is preempted (recompute: its blocks are freed and it goes to the front of the
waiting queue). Then waiting requests are admitted in arrival order (preempted ones first) while
budget, sequence slots and blocks last; admission never skips ahead of a request that does not fit
(only ahead of one whose structured-output grammar is still compiling).

No deadlock: requests that could never fit (longer than ``max_model_len``, needing more blocks
than the pool has, or, without chunked prefill, a prompt over the budget) never get here: the
engine refuses them at its door with ``rejection_reason`` (the one check of a request's size), and
``add_request`` asserts it. So the oldest running request always fits once everything newer is
preempted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.config import CacheConfig, SchedulerConfig
from backend.engine.outputs import StepStats
from backend.engine.request import Request, RequestStatus
from backend.kv_cache.manager import KVCacheManager
from backend.models.shape import ceil_div
from backend.protocol.outputs import FinishReason
from backend.runner.scheduled import ScheduledRequest


@dataclass(slots=True)
class SchedulerOutput:
    # Running requests first, then newly admitted ones, in scheduling order.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)  # this step; now waiting again

    def step_stats(self) -> StepStats:
        """Token counts of the step: a decode is one new token after the prompt, the rest is prefill."""
        stats = StepStats(num_seqs=len(self.scheduled), num_preempted=len(self.preempted))
        for item in self.scheduled:
            if item.spec_token_ids:  # a decode with proposals to verify
                stats.num_decode_tokens += item.num_new_tokens
                stats.num_spec_tokens += len(item.spec_token_ids)
            elif item.num_new_tokens == 1 and item.request.num_prompt_tokens <= item.num_computed_tokens:
                stats.num_decode_tokens += 1
            else:
                stats.num_prefill_tokens += item.num_new_tokens
        return stats


def priority_key(request: Request) -> tuple[int, float]:
    """Lower runs first: the request's priority, then its arrival."""
    return request.sampling_params.priority, request.arrival_time


class Scheduler:
    """Owns the waiting queue and the running list; the engine drives it once per step."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        kv_cache_manager: KVCacheManager,
        is_held: Callable[[Request], bool] | None = None,
    ) -> None:
        """``is_held(request)``: a request that waits on something outside the scheduler (its grammar
        still compiles, or it is a beam whose next step waits for its siblings); the engine says
        which. A held waiting request is stepped over; a held running one may give up its blocks."""
        if cache_config.block_size != kv_cache_manager.block_size:
            raise ValueError(
                f"block_size mismatch: cache_config {cache_config.block_size}, "
                f"kv_cache_manager {kv_cache_manager.block_size}"
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total since start
        self.priority_policy = scheduler_config.scheduling_policy == "priority"
        self.is_held = is_held or (lambda request: False)
        self.max_loras = 0  # distinct LoRA adapters in the running batch at most (0: no adapters, no limit)

    # ----- queue state --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run."""
        return bool(self.running or self.waiting)

    # ----- admission, abort, finish -------------------------------------------------------------
    def rejection_reason(self, request: Request) -> str | None:
        """Why ``request`` could never be scheduled, naming the field; None when it fits.

        The engine asks this once, before it queues anything (``add_request`` only asserts it):
        an empty prompt, prompt + max_tokens beyond max_model_len, more KV blocks than the pool
        has, or, without chunked prefill, a prompt over the token budget.
        """
        num_prompt = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        total = num_prompt + max_tokens
        if num_prompt == 0:
            return "text_input: the prompt is empty and the tokenizer adds no BOS token"
        if num_prompt >= self.max_model_len:
            return (f"text_input: the prompt has {num_prompt} tokens; max_model_len is {self.max_model_len} "
                    "(prompt + output)")
        if total > self.max_model_len:
            return (f"max_tokens: {max_tokens} plus the prompt's {num_prompt} tokens exceeds max_model_len "
                    f"({self.max_model_len})")
        kv = self.kv_cache_manager
        budget = self.scheduler_config.max_num_batched_tokens
        num_needed = kv.max_blocks_held(total, budget)  # with a sliding window: the window's blocks and a chunk's
        num_usable = kv.num_blocks - 1
        if num_needed > num_usable:
            return (f"max_tokens: prompt + max_tokens = {total} tokens need {num_needed} KV cache blocks of "
                    f"{kv.block_size} tokens, but the cache has only {num_usable}")
        if not self.scheduler_config.enable_chunked_prefill and num_prompt > budget:
            return (f"text_input: the prompt ({num_prompt} tokens) exceeds max_num_batched_tokens ({budget}) "
                    "and chunked prefill is disabled")
        return None

    def add_request(self, request: Request) -> None:
        """Queues a request the engine checked (``rejection_reason`` is None)."""
        assert self.rejection_reason(request) is None, (request.request_id, self.rejection_reason(request))
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def add_forked(self, parent: Request, child: Request) -> None:
        """A sample or beam forked from ``parent`` (backend/engine/output_processor.py): a running
        parent shares its blocks with the child, which runs from the next step; a preempted parent's
        child waits and recomputes, as the parent will."""
        if parent.status == RequestStatus.RUNNING:
            child.status = RequestStatus.RUNNING
            self.kv_cache_manager.fork(parent, child)
            self.running.append(child)
        else:
            self.add_request(child)

    def rollback_speculation(self, request: Request) -> None:
        """Forgets the KV past the request's known tokens: the slots of rejected (or never
        verified) proposals. The last known token's KV comes with the next step. The one place a
        request's KV is cut back."""
        request.num_computed_tokens = request.num_tokens - 1
        self.kv_cache_manager.trim(request, request.num_tokens)

    def abort_request(self, request: Request) -> bool:
        """Aborts a waiting or running request (freeing its blocks); False when it is not here.

        Call it between steps, never between schedule() and running that step: a request in the
        same step may already be using blocks this one is about to write.
        """
        if not self._holds(request):
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED, FinishReason.ABORT)
        return True

    def _holds(self, request: Request) -> bool:
        """Whether ``request`` is running or waiting here (by identity; aborts are rare)."""
        queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
        return any(r is request for r in queue)

    def finish_request(self, request: Request, status: RequestStatus, finish_reason: FinishReason) -> None:
        """The engine saw eos / a stop / the length limit: the request leaves and frees its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        if not self._holds(request):
            raise ValueError(f"request {request.request_id!r} is not waiting or running")
        self._finish(request, status, finish_reason)

    def _finish(self, request: Request, status: RequestStatus, finish_reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finish_reason = finish_reason
        self.kv_cache_manager.free(request)  # finished: a prefill engine may keep its prompt's blocks

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, start over from the front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """FCFS: at the back (a preempted request at the front). Priority: behind every waiting request
        of the same or a better (priority, arrival), so a preempted one keeps its rank."""
        if not self.priority_policy:
            if front:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        key = priority_key(request)
        index = len(self.waiting)
        while index > 0 and priority_key(self.waiting[index - 1]) > key:
            index -= 1
        self.waiting.insert(index, request)

    def _preempt_lower_priority(self, request: Request, output: SchedulerOutput) -> int | None:
        """Priority policy: preempts the lowest-priority running request if it ranks below ``request``
        (its share of this step is taken back); returns the tokens that frees, None if none does."""
        if not self.priority_policy or not self.running:
            return None
        victim = max(self.running, key=priority_key)
        if victim.sampling_params.priority <= request.sampling_params.priority:
            return None
        freed = 0
        for index, item in enumerate(output.scheduled):
            if item.request is victim:
                freed = item.num_new_tokens
                del output.scheduled[index]
                break
        self.running.remove(victim)
        self._preempt(victim)
        output.preempted.append(victim)
        return freed

    def _preempt_an_idle_request(self, output: SchedulerOutput) -> None:
        """Nothing could run and requests wait: a held running request with nothing to compute (a beam
        whose next step waits for a sibling's log-probabilities; it keeps its own) holds blocks that
        the waiting ones need. The newest such request gives them up (it recomputes later), so the
        waiting sibling can come in; without this the two would wait for each other for good."""
        for index in range(len(self.running) - 1, -1, -1):
            request = self.running[index]
            if self.is_held(request) and request.num_computed_tokens >= request.num_tokens:
                del self.running[index]
                self._preempt(request)
                output.preempted.append(request)
                return

    def _fit_speculation(self, request: Request, num_new_tokens: int, token_budget: int, num_after: int) -> list[int]:
        """The part of ``request.spec.token_ids`` that this step can verify: the request decodes
        (one new token), the budget has room after it, and the pool has blocks for them while
        keeping a block for each of the ``num_after`` running requests still to schedule, so
        speculation never causes a preemption (allocated here). [] otherwise: the request decodes
        as usual."""
        spec = request.spec.token_ids
        if not spec or num_new_tokens != 1:
            return []
        spec = spec[: max(0, token_budget - 1)]
        kv = self.kv_cache_manager
        if not spec or kv.allocate_slots(request, 1 + len(spec)) is None:
            return []
        if kv.num_free_blocks < num_after:
            self.rollback_speculation(request)  # give the proposals' blocks back
            return []
        return spec

    # ----- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Picks this step's tokens and allocates their slots; advances ``num_computed_tokens``."""
        config = self.scheduler_config
        output = SchedulerOutput()
        token_budget = self._schedule_running(output, config.max_num_batched_tokens)
        token_budget = self._schedule_waiting(output, token_budget)
        # The KV of the scheduled tokens counts as computed once this step runs.
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        output.num_scheduled_tokens = config.max_num_batched_tokens - token_budget
        return output

    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> int:
        """Running requests, oldest first (priority policy: highest priority first); preempts from
        the end (the newest, or the lowest priority) when blocks run out. Returns the budget left."""
        kv = self.kv_cache_manager
        scheduled = output.scheduled
        if self.priority_policy:
            self.running.sort(key=priority_key)
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens <= 0:  # nothing new (no token was appended since its last step)
                req_index += 1
                continue
            spec = self._fit_speculation(request, num_new_tokens, token_budget, len(self.running) - req_index - 1)
            if spec:  # proposed tokens ride along when budget and blocks allow; never worth a preemption
                scheduled.append(ScheduledRequest(request, num_new_tokens + len(spec), request.num_computed_tokens,
                                                  kv.get_block_ids(request.request_id), spec))
                token_budget -= num_new_tokens + len(spec)
                req_index += 1
                continue
            while not self._allocate(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:  # it preempted itself: nothing else fits
                break
            scheduled.append(
                ScheduledRequest(
                    request, num_new_tokens, request.num_computed_tokens, kv.get_block_ids(request.request_id)
                )
            )
            token_budget -= num_new_tokens
            req_index += 1
        return token_budget

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> int:
        """Waiting requests in arrival order (preempted ones sit at the front); under the priority
        policy in (priority, arrival) order, and a waiting request may preempt a running one of a
        lower priority for its seat or its blocks. Like vLLM, admits none in a step that had to
        preempt for running requests: the pool is short of blocks. A held request (``is_held``) or
        one whose KV still loads from the offload tier is stepped over (it keeps its place for the
        next step). Returns the budget left."""
        config = self.scheduler_config
        kv = self.kv_cache_manager
        blocks_short = bool(output.preempted)
        stepped_over: list[Request] = []
        while self.waiting and not blocks_short and token_budget > 0:
            request = self.waiting[0]
            if self.is_held(request):
                stepped_over.append(self.waiting.popleft())
                continue
            if len(self.running) >= config.max_num_seqs:
                freed = self._preempt_lower_priority(request, output)
                if freed is None:
                    break
                token_budget += freed
                continue
            if self._adapter_waits(request):  # its adapter would be one too many: it waits its turn, and
                break  # nobody behind it goes first (FCFS), so it cannot starve
            assert request.num_computed_tokens == 0, "waiting requests have no KV"
            if kv.restore_in_flight(request):
                stepped_over.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            restored = kv.find_external(request, computed_blocks, batch_running=bool(self.running))
            if restored is None:
                stepped_over.append(self.waiting.popleft())
                continue
            num_restored_tokens = len(restored) * kv.block_size
            num_hit_tokens += num_restored_tokens
            num_new_tokens = request.num_tokens - num_hit_tokens
            if num_new_tokens > token_budget:
                # Without chunked prefill a prompt waits for a step with room for all of it. A
                # preempted request whose outputs pushed it past the whole budget could never
                # get such a step: it is chunked anyway, or it would wait forever.
                if not config.enable_chunked_prefill and num_new_tokens <= config.max_num_batched_tokens:
                    break
                num_new_tokens = token_budget
            if not self._allocate(request, num_restored_tokens + num_new_tokens, computed_blocks):
                freed = self._preempt_lower_priority(request, output)
                if freed is None:
                    break
                token_budget += freed
                continue
            kv.place_restored(request, len(computed_blocks), restored)
            self._start_running(request, num_hit_tokens)
            output.scheduled.append(
                ScheduledRequest(request, num_new_tokens, num_hit_tokens, kv.get_block_ids(request.request_id)))
            token_budget -= num_new_tokens
        if not output.scheduled and self.waiting:  # (stepped-over requests are out of self.waiting here)
            self._preempt_an_idle_request(output)  # a waiting request could run but has no room
        self.waiting.extendleft(reversed(stepped_over))
        return token_budget

    def _adapter_waits(self, request: Request) -> bool:
        """Whether admitting ``request`` would put more than ``max_loras`` distinct LoRA adapters in
        the running batch."""
        name = request.sampling_params.lora_name
        if name is None or not self.max_loras:
            return False
        running = {r.sampling_params.lora_name for r in self.running} - {None}
        return name not in running and len(running) >= self.max_loras

    def _allocate(self, request: Request, num_new_tokens: int, computed_blocks=()) -> bool:
        """``allocate_slots``; when the pool is short, blocks a prefill engine keeps for pulls are
        given up first (before anyone is preempted or has to wait), and it is tried once more."""
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_new_tokens, computed_blocks) is not None:
            return True
        needed = ceil_div(num_new_tokens, kv.block_size) + 1
        return kv.reclaim_kept(needed) and kv.allocate_slots(request, num_new_tokens, computed_blocks) is not None

    def _start_running(self, request: Request, num_hit_tokens: int) -> None:
        """The head of the waiting queue moves to the running list with its prefix hit computed."""
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.first_scheduled_time is None:  # first scheduling, not a resumed preemption
            request.num_cached_tokens = num_hit_tokens
            request.first_scheduled_time = time.monotonic()
