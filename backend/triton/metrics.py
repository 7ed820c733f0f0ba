"""Prometheus metrics on Triton's own /metrics endpoint, through pb_utils.MetricFamily.

Names and definitions follow the guide's metrics table (docs/metrics.md) (vLLM's metrics design): TTFT = submission to
the first token sent; ITL = gap between tokens sent; TPOT = (e2e - TTFT) / (output tokens - 1).
Every family object is kept referenced for the model's lifetime: a dropped family makes later
calls fail.
"""

from __future__ import annotations

from typing import Protocol

from backend.protocol.outputs import EngineStats, FinishReason, RequestOutput

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
IPC_BUCKETS = [0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1]
COMPILE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TOKEN_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("length", "stop", "eos", "abort", "error")


class RequestTiming(Protocol):
    """Client-visible timing of one request (monotonic seconds), kept by whoever sends its responses."""

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None


def record_tokens(timing: RequestTiming, output: RequestOutput, now: float, metrics: TritonMetrics | None) -> None:
    """Notes that ``output``'s tokens were sent at ``now``: TTFT once, ITL after, token counters."""
    if timing.first_token_time is None:
        timing.first_token_time = now
        if metrics is not None:
            metrics.ttft.observe(now - timing.arrival_time)
            metrics.prompt_tokens.increment(output.num_prompt_tokens)
            if output.first_scheduled_time is not None:
                metrics.queue_time.observe(max(0.0, output.first_scheduled_time - timing.arrival_time))
    elif metrics is not None and timing.last_token_time is not None:
        metrics.itl.observe(now - timing.last_token_time)
    timing.last_token_time = now
    if metrics is not None:
        metrics.generation_tokens.increment(len(output.new_token_ids))


def record_finish(timing: RequestTiming, output: RequestOutput, now: float, metrics: TritonMetrics | None) -> None:
    """Counts a finished request by reason; successful ones also feed e2e, TPOT and size histograms.
    The batched token counters are sent first: a client that got its FINAL finds its tokens counted."""
    if metrics is None:
        return
    metrics.flush_counters()
    reason = output.finish_reason.value if output.finish_reason is not None else "error"
    if output.error is not None and output.finish_reason is not FinishReason.ABORT:
        reason = "error"
    metrics.success[reason].increment(1)
    if output.error is not None or reason == "abort":
        return
    metrics.e2e.observe(now - timing.arrival_time)
    metrics.prompt_tokens_hist.observe(output.num_prompt_tokens)
    metrics.generation_tokens_hist.observe(output.num_output_tokens)
    if timing.first_token_time is not None and output.num_output_tokens > 1:
        metrics.tpot.observe((now - timing.first_token_time) / (output.num_output_tokens - 1))


# EngineStats field -> a counter that grows by the field's change, with its description
CUMULATIVE_COUNTERS = (
    ("kv_offload_stored_blocks", "llm_kv_offload_stored_blocks_total",
     "KV blocks evicted from the pool and written to the offload tier"),
    ("kv_offload_stored_bytes", "llm_kv_offload_stored_bytes_total", "Bytes written to the KV offload tier"),
    ("kv_offload_restored_blocks", "llm_kv_offload_restored_blocks_total", "KV blocks loaded back from the offload tier"),
    ("kv_offload_restored_bytes", "llm_kv_offload_restored_bytes_total", "Bytes loaded back from the KV offload tier"),
    ("kv_offload_hits", "llm_kv_offload_hits_total", "Blocks missing from the pool that the offload tier held"),
    ("kv_offload_misses", "llm_kv_offload_misses_total", "Blocks missing from the pool and from the offload tier"),
    ("kv_offload_recomputed_blocks", "llm_kv_offload_recomputed_blocks_total",
     "Blocks the offload tier held that the cost rule chose to recompute"),
    ("kv_offload_dropped_blocks", "llm_kv_offload_dropped_blocks_total",
     "Evicted blocks not offloaded because the write queue was full"),
    ("kv_events_published_batches", "llm_kv_events_published_total",
     "KV-cache event batches published for routers (kv_events_endpoint)"),
    ("kv_events_dropped_batches", "llm_kv_events_dropped_total",
     "KV-cache event batches dropped because the publisher's queue was full"),
    ("kv_transfer_pinned_requests", "llm_kv_transfer_pinned_requests_total",
     "Prefill engine: finished prompts whose KV blocks were kept for a decode engine's pull"),
    ("kv_transfer_served_pulls", "llm_kv_transfer_served_total", "Prefill engine: pulls answered with blocks"),
    ("kv_transfer_sent_bytes", "llm_kv_transfer_sent_bytes_total", "Prefill engine: KV bytes sent to decode engines"),
    ("kv_transfer_refused_pulls", "llm_kv_transfer_refused_total",
     "Prefill engine: pulls refused (unknown, used or expired token; bad range; malformed message)"),
    ("kv_transfer_expired_pins", "llm_kv_transfer_expired_total",
     "Prefill engine: kept prompts never pulled within kv_transfer_timeout_seconds"),
    ("kv_transfer_reclaimed_pins", "llm_kv_transfer_reclaimed_total",
     "Prefill engine: kept prompts given up early because running requests needed the blocks"),
    ("kv_transfer_pulls", "llm_kv_transfer_pulls_total", "Decode engine: prompts whose KV blocks were pulled whole"),
    ("kv_transfer_received_bytes", "llm_kv_transfer_received_bytes_total",
     "Decode engine: KV bytes pulled from prefill engines"),
    ("kv_transfer_fallbacks", "llm_kv_transfer_fallbacks_total",
     "Decode engine: pulls that failed or came short, so the prompt (or its rest) was recomputed here"),
    ("lora_loads", "llm_lora_loads_total", "LoRA adapters loaded from their folders"),
    ("cpu_thread_reductions", "llm_engine_cpu_thread_reductions_total",
     "Times the engine's CPU threads were cut because other processes held the cores (cpu_adaptive_threads)"),
)
OFFLOAD_LOAD_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


class BatchedCounter:
    """A counter whose increments add up here and reach Triton in one call per step.

    Every pb_utils metric call is a round trip from the stub to tritonserver; the token counters
    were two of them per streamed token. ``flush`` sends what added up (update_engine_stats does
    once a step, record_finish before a request's FINAL goes out).
    """

    def __init__(self, metric):
        self.metric = metric  # keeps the pb_utils metric (and so its family) alive
        self.pending = 0

    def increment(self, value) -> None:
        self.pending += value

    def flush(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, 0
            self.metric.increment(pending)


class TritonMetrics:
    """Owns the metric families and metrics of one model instance."""

    def __init__(self, pb_utils, model_name: str, load=None):
        """``load``: the cluster schedulers' names of the load gauges (backend/triton/load_metrics.py)."""
        self.load = load
        self._labels = {"model": model_name}
        self._family = pb_utils.MetricFamily
        self._families = []  # every family stays referenced (Triton 2.51: a dropped one breaks later calls)
        self._make_request_metrics()
        self._make_engine_metrics()
        self._make_feature_metrics()
        self._last_stats: EngineStats | None = None

    def _new_family(self, name: str, description: str, kind):
        family = self._family(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def _make(self, name: str, description: str, kind, buckets=None):
        """A family of one metric, labelled with the model."""
        family = self._new_family(name, description, kind)
        if buckets is None:
            return family.Metric(labels=dict(self._labels))
        return family.Metric(labels=dict(self._labels), buckets=buckets)

    def _make_request_metrics(self) -> None:
        """Per-request latencies and token counts, and finished requests by reason."""
        H, C = self._family.HISTOGRAM, self._family.COUNTER
        self.ttft = self._make("llm_time_to_first_token_seconds", "Time from submission to the first token", H, LATENCY_BUCKETS)
        self.itl = self._make("llm_inter_token_latency_seconds", "Gap between streamed tokens", H, LATENCY_BUCKETS)
        self.tpot = self._make("llm_time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1)", H, LATENCY_BUCKETS)
        self.e2e = self._make("llm_e2e_request_latency_seconds", "Submission to the final response", H, LATENCY_BUCKETS)
        self.queue_time = self._make("llm_request_queue_time_seconds", "Submission to first scheduling", H, LATENCY_BUCKETS)
        self.prompt_tokens_hist = self._make("llm_request_prompt_tokens", "Prompt tokens per request", H, TOKEN_BUCKETS)
        self.generation_tokens_hist = self._make("llm_request_generation_tokens", "Output tokens per request", H, TOKEN_BUCKETS)
        prompt_tokens = self._make("llm_prompt_tokens_total", "Prompt tokens of requests that produced a token", C)
        generation_tokens = self._make("llm_generation_tokens_total", "Output tokens sent to clients", C)
        self.prompt_tokens, self.generation_tokens = BatchedCounter(prompt_tokens), BatchedCounter(generation_tokens)
        success_family = self._new_family("llm_request_success_total", "Finished requests by finish reason", C)
        self.success = {reason: success_family.Metric(labels=dict(self._labels, finish_reason=reason)) for reason in FINISH_REASONS}

    def _make_engine_metrics(self) -> None:
        """The engine's batch, cache, restarts and IPC."""
        H, C, G = self._family.HISTOGRAM, self._family.COUNTER, self._family.GAUGE
        self.preemptions = self._make("llm_num_preemptions_total", "Requests preempted (recompute)", C)
        self.prefix_queries = self._make("llm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", C)
        self.prefix_hits = self._make("llm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", C)
        self.running = self._make("llm_num_requests_running", "Requests in the running batch", G)
        self.waiting = self._make("llm_num_requests_waiting", "Requests waiting to be scheduled", G)
        self.kv_usage = self._make("llm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", G)
        self.kv_shared = self._make("llm_kv_cache_shared_blocks",
                                    "KV blocks saved by sharing (prefix hits, forked samples): references beyond the first", G)
        self.engine_restarts = self._make("llm_engine_restarts_total",
                                         "Engine-core processes that died or hung and were restarted", C)
        self.stub_recoveries = self._make("llm_stub_recoveries_total",
                                          "Times this model's stub died while serving and the model was reloaded", C)
        self.core_ipc = self._make("llm_engine_core_ipc_seconds",
                                   "A step's outputs from the engine-core process to the front end", H, IPC_BUCKETS)

    def _make_feature_metrics(self) -> None:
        """Structured output, the offload tier and transfers, LoRA, threads and speculation."""
        H, C, G = self._family.HISTOGRAM, self._family.COUNTER, self._family.GAUGE
        self.grammar_compile = self._make("llm_structured_output_compile_seconds",
                                          "Compiling one structured-output constraint into token masks", H, COMPILE_BUCKETS)
        self.grammar_compiles = self._make("llm_structured_output_compiles_total",
                                           "Structured-output constraints compiled (cache misses)", C)
        self.grammar_cache_hits = self._make("llm_structured_output_cache_hits_total",
                                             "Constrained requests whose grammar was already compiled or compiling", C)
        self.cumulative_counters = {
            field_name: self._make(name, description, C) for field_name, name, description in CUMULATIVE_COUNTERS
        }
        self.offload_load = self._make("llm_kv_offload_load_seconds",
                                       "Loading one request's blocks from the KV offload tier", H, OFFLOAD_LOAD_BUCKETS)
        self.transfer_pull = self._make("llm_kv_transfer_pull_seconds",
                                        "Decode engine: pulling one prompt's KV blocks from a prefill engine", H,
                                        OFFLOAD_LOAD_BUCKETS)
        self.transfer_pinned = self._make("llm_kv_transfer_pinned_blocks",
                                          "Prefill engine: KV blocks kept for decode engines' pulls", G)
        self.lora_load = self._make("llm_lora_load_seconds", "Loading one LoRA adapter from its folder", H,
                                    OFFLOAD_LOAD_BUCKETS)
        self.lora_loaded = self._make("llm_lora_loaded_adapters", "LoRA adapters in memory", G)
        self.cpu_threads = self._make("llm_engine_cpu_threads",
                                      "The engine's torch threads on the CPU now (0: fixed, see cpu_adaptive_threads)", G)
        self._lora_requests_family = self._new_family("llm_lora_requests_total", "Requests added, by LoRA adapter", C)
        self.lora_requests: dict[str, object] = {}  # adapter -> its counter, made on first sight
        self.spec_draft = self._make("llm_spec_decode_num_draft_tokens_total", "Speculative tokens proposed and verified", C)
        self.spec_accepted = self._make("llm_spec_decode_num_accepted_tokens_total",
                                        "Speculative tokens the target model accepted", C)
        self._spec_position_family = self._new_family(
            "llm_spec_decode_num_accepted_tokens_per_pos_total",
            "Speculative tokens accepted, by position in the proposal (0 first)", C)
        self._spec_labels = self._labels
        self.spec_accepted_per_position = []  # made when the first stats say how many positions there are
        self.spec_steps = self._make("llm_spec_decode_num_steps_total",
                                     "Engine steps with a request that could speculate", C)
        self.spec_speculated_steps = self._make("llm_spec_decode_num_speculated_steps_total",
                                                "Of those steps, the ones the speculation controller let speculate", C)
        self.spec_speculated_fraction = self._make("llm_spec_decode_speculated_step_fraction",
                                                   "Speculated steps / steps that could speculate, since start", G)

    def flush_counters(self) -> None:
        """Sends the token counts added up since the last flush (BatchedCounter)."""
        self.prompt_tokens.flush()
        self.generation_tokens.flush()

    def update_engine_stats(self, stats: EngineStats) -> None:
        """Gauges are set; counters grow by the change since the last update; the step's token
        counts are sent."""
        self.flush_counters()
        last = self._last_stats
        if last is None or stats.num_running != last.num_running:
            self.running.set(stats.num_running)
        if last is None or stats.num_waiting != last.num_waiting:
            self.waiting.set(stats.num_waiting)
        if last is None or stats.kv_cache_usage != last.kv_cache_usage:
            self.kv_usage.set(stats.kv_cache_usage)
        if last is None or stats.kv_shared_blocks != last.kv_shared_blocks:
            self.kv_shared.set(stats.kv_shared_blocks)
        if last is not None:
            for metric, now, before in (
                (self.preemptions, stats.num_preemptions, last.num_preemptions),
                (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.grammar_compiles, stats.grammar_compiles, last.grammar_compiles),
                (self.grammar_cache_hits, stats.grammar_cache_hits, last.grammar_cache_hits),
            ):
                if now > before:
                    metric.increment(now - before)
        else:
            for metric, now in (
                (self.preemptions, stats.num_preemptions),
                (self.prefix_queries, stats.prefix_cache_queries),
                (self.prefix_hits, stats.prefix_cache_hits),
                (self.grammar_compiles, stats.grammar_compiles),
                (self.grammar_cache_hits, stats.grammar_cache_hits),
            ):
                if now:
                    metric.increment(now)
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile.observe(seconds)
        for field_name, metric in self.cumulative_counters.items():
            now, before = getattr(stats, field_name), getattr(last, field_name) if last is not None else 0
            if now > before:
                metric.increment(now - before)
        for seconds in stats.kv_offload_load_seconds:
            self.offload_load.observe(seconds)
        for seconds in stats.kv_transfer_pull_seconds:
            self.transfer_pull.observe(seconds)
        if last is None or stats.kv_transfer_pinned_blocks != last.kv_transfer_pinned_blocks:
            self.transfer_pinned.set(stats.kv_transfer_pinned_blocks)
        if last is None or stats.cpu_threads != last.cpu_threads:
            self.cpu_threads.set(stats.cpu_threads)
        self._update_spec_decode(stats, last)
        self._update_lora(stats, last)
        if self.load is not None:
            self.load.update(stats)
        self._last_stats = stats

    def _update_lora(self, stats: EngineStats, last: EngineStats | None) -> None:
        for seconds in stats.lora_load_seconds:
            self.lora_load.observe(seconds)
        if last is None or stats.lora_loaded != last.lora_loaded:
            self.lora_loaded.set(stats.lora_loaded)
        before = last.lora_requests if last is not None else {}
        for name, count in stats.lora_requests.items():
            if count > before.get(name, 0):
                metric = self.lora_requests.get(name)
                if metric is None:
                    metric = self.lora_requests[name] = self._lora_requests_family.Metric(
                        labels=dict(self._spec_labels, lora_name=name))
                metric.increment(count - before.get(name, 0))

    def _update_spec_decode(self, stats: EngineStats, last: EngineStats | None) -> None:
        if not stats.spec_decode_num_steps:
            return
        for metric, name in ((self.spec_draft, "spec_decode_num_draft_tokens"),
                             (self.spec_accepted, "spec_decode_num_accepted_tokens"),
                             (self.spec_steps, "spec_decode_num_steps"),
                             (self.spec_speculated_steps, "spec_decode_num_speculated_steps")):
            now, before = getattr(stats, name), getattr(last, name) if last is not None else 0
            if now > before:
                metric.increment(now - before)
        while len(self.spec_accepted_per_position) < len(stats.spec_decode_accepted_per_position):
            position = len(self.spec_accepted_per_position)
            self.spec_accepted_per_position.append(
                self._spec_position_family.Metric(labels=dict(self._spec_labels, position=str(position))))
        before_positions = last.spec_decode_accepted_per_position if last is not None else []
        for position, now in enumerate(stats.spec_decode_accepted_per_position):
            before = before_positions[position] if position < len(before_positions) else 0
            if now > before:
                self.spec_accepted_per_position[position].increment(now - before)
        self.spec_speculated_fraction.set(stats.spec_decode_num_speculated_steps / stats.spec_decode_num_steps)

    def close(self) -> None:
        if self.load is not None:
            self.load.close()
        self.success.clear()
        self.spec_accepted_per_position.clear()
        self.lora_requests.clear()
        self._families.clear()
