"""The engine's statistics after a step, gathered from the scheduler, the KV cache and the optional
pieces (grammars, the offload tier, speculation): what Triton's metrics and the engine-core
messages carry (backend/protocol/outputs.py: EngineStats)."""

from __future__ import annotations

from backend.protocol.outputs import EngineStats


def collect_engine_stats(engine) -> EngineStats:
    """``engine``: an LLMEngine. Cumulative counters, except the lists of durations since the last call."""
    manager = engine.kv_cache_manager
    return EngineStats(
        num_running=engine.scheduler.num_running,
        num_waiting=engine.scheduler.num_waiting,
        kv_cache_usage=manager.usage,
        num_kv_blocks=engine.num_kv_blocks,
        prefix_cache_queries=manager.prefix_queries,
        prefix_cache_hits=manager.prefix_hits,
        num_preemptions=engine.scheduler.num_preemptions,
        kv_shared_blocks=manager.block_pool.num_shared_references,
        **_grammar_stats(engine.structured_output),
        **_offload_stats(engine.offloader),
        **_spec_decode_stats(engine.speculator),
        **_kv_event_stats(engine.kv_event_publisher),
        **_kv_transfer_stats(engine.kv_transfer),
        **_lora_stats(engine),
        **_thread_stats(engine.cpu_threads),
    )


def _thread_stats(governor) -> dict:
    if governor is None:
        return {}
    return {"cpu_threads": governor.threads, "cpu_thread_reductions": governor.reductions}


def _grammar_stats(structured_output) -> dict:
    if structured_output is None:
        return {}
    compiler = structured_output.compiler
    return {"grammar_compiles": compiler.num_compiles, "grammar_cache_hits": compiler.num_cache_hits,
            "grammar_compile_seconds": compiler.take_compile_seconds()}


def _offload_stats(offloader) -> dict:
    if offloader is None:
        return {}
    stats = offloader.stats
    return {"kv_offload_stored_blocks": stats.stored_blocks, "kv_offload_stored_bytes": stats.stored_bytes,
            "kv_offload_restored_blocks": stats.restored_blocks, "kv_offload_restored_bytes": stats.restored_bytes,
            "kv_offload_hits": stats.hit_blocks, "kv_offload_misses": stats.miss_blocks,
            "kv_offload_recomputed_blocks": stats.recomputed_blocks,
            "kv_offload_dropped_blocks": stats.dropped_blocks,
            "kv_offload_load_seconds": offloader.take_load_seconds()}


def _kv_event_stats(publisher) -> dict:
    if publisher is None:
        return {}
    return {"kv_events_published_batches": publisher.stats.published_batches,
            "kv_events_dropped_batches": publisher.stats.dropped_batches}


def _lora_stats(engine) -> dict:
    if engine.lora is None:
        return {}
    scheduler = engine.scheduler
    return engine.lora.engine_stats_fields({r.sampling_params.lora_name for r in scheduler.running},
                                           {r.sampling_params.lora_name for r in scheduler.waiting})


def _kv_transfer_stats(transfer) -> dict:
    """A prefill engine's transfer server or a decode engine's puller (backend/kv_transfer)."""
    return {} if transfer is None else transfer.engine_stats_fields()


def _spec_decode_stats(speculator) -> dict:
    if speculator is None:
        return {}
    stats = speculator.snapshot()
    return {"spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_accepted_per_position": stats.accepted_per_position,
            "spec_decode_num_steps": stats.num_steps,
            "spec_decode_num_speculated_steps": stats.num_speculated_steps}
