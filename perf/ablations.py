"""Engine ablations: what continuous batching, prefix caching, chunked prefill and paging each buy.

Each ablation runs our own engine in-process (no server) on the demo model twice, with a feature on
and off, on the same seeded workload in the same run, and reports one ratio:

1. ``inflight``: continuous (inflight) batching vs request-level static batching (admit a batch of
   B requests, run until all finish, only then admit the next), same max_num_seqs = B; output tok/s.
2. ``prefix_caching``: on vs off on a shared-prefix workload (N system prompts reused by many
   requests with unique suffixes), requests one at a time so TTFT is prefill work, not queueing;
   TTFT p50 (the two engines alternate request by request, so machine noise hits both alike).
3. ``chunked_prefill``: on (small token budget) vs off (budget >= max_model_len) when long prompts
   arrive among running decodes; ITL p99 of the decoding requests.
4. ``paged_kv``: with a fixed pool of K blocks, how many requests of a chat-like mix run at once
   with paging (measured: peak num_running of the engine with a large max_num_seqs) vs reserving
   max_model_len tokens per request (computed: K * block_size // max_model_len).

Arrivals are simulated on the engine's clock: the driver steps the engine in a loop and adds a
request when its arrival condition holds (all at start, when the engine is idle for static
batching, or at a given step index). TTFT = arrival to first token; ITL = gaps between a
request's token outputs (timestamps taken right after each step). The prompts are client.bench's
workloads (corpus text on the model's tokenizer, as token ids).

    .venv/bin/python -m perf.ablations [--only NAME] [--smoke] [--out-json F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.models.shape import ceil_div
from backend.paths import REPO_ROOT
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.stats import percentile
from client.bench.workload import SharedPrefix
from perf.engine_driver import (
    EngineDriver,
    add_model_folder_argument,
    prompt_builder,
    token_workload,
    warm_up,
)

ABLATIONS = ("inflight", "prefix_caching", "chunked_prefill", "paged_kv")
PROGRESS_INTERVAL_S = 5.0

# Workload sizes: "full" for the measured run, "smoke" for the unit test (seconds, not minutes).
SIZES = {
    "full": {  # sized for minutes, not hours, on 2 shared cores
        "inflight": {"num_requests": 24, "prompt_range": (32, 256), "output_range": (16, 64), "batch_size": 8},
        "prefix_caching": {"num_system_prompts": 4, "system_len": 512, "num_requests": 24, "suffix_len": 32,
                           "output_len": 8},
        "chunked_prefill": {"num_decoders": 6, "decoder_prompt_range": (32, 64), "decoder_output_len": 64,
                            "long_prompt_len": 2000, "long_output_len": 4, "long_arrival_steps": (6, 26, 46),
                            "max_model_len": 4096, "chunk_budget": 512},
        "paged_kv": {"num_requests": 40, "num_blocks": 512, "max_model_len": 2048, "prompt_median": 192,
                     "output_median": 96},
    },
    "smoke": {
        "inflight": {"num_requests": 4, "prompt_range": (8, 16), "output_range": (2, 3), "batch_size": 2},
        "prefix_caching": {"num_system_prompts": 2, "system_len": 32, "num_requests": 4, "suffix_len": 8,
                           "output_len": 2},
        "chunked_prefill": {"num_decoders": 2, "decoder_prompt_range": (8, 16), "decoder_output_len": 6,
                            "long_prompt_len": 64, "long_output_len": 2, "long_arrival_steps": (1, 3),
                            "max_model_len": 256, "chunk_budget": 32},
        "paged_kv": {"num_requests": 4, "num_blocks": 32, "max_model_len": 256, "prompt_median": 16,
                     "output_median": 4},
    },
}


# ------------------------------------------------------------------------------------ helpers
def make_engine(model_folder: str, overrides: dict[str, str], warm_prompt: list[int]):
    engine = LLMEngine(engine_config_from_model_folder(model_folder, **overrides))
    warm_up(engine, warm_prompt[:8])
    return engine


class Sim:
    """Feeds ``requests`` (dicts: prompt, max_tokens, optional at_step) to ``engine`` one step at a time.

    Time is the engine's own clock: the sum of its own steps' durations (add_request + step()),
    so two engines advanced alternately (:func:`interleave`) see the same machine noise, and a
    neighbour's step never counts as ours. TTFT = arrival to the step that produced the first
    token; ITL = gaps between a request's token-producing steps. The requests go through
    perf/engine_driver.py, the driver every in-process benchmark uses.

    static_batch > 0: request-level batching: the next ``static_batch`` requests are added only
    when the engine has nothing unfinished. Otherwise a request arrives once ``at_step`` (default
    0) steps have run. Arrival time: the run's start when ``arrive_at_start`` (all queued then),
    else the moment it is added. stop_when_drained: stop (aborting what still runs) once every
    request has arrived and none waits any more: concurrency only falls after that.
    """

    def __init__(self, engine, requests: list[dict], label: str, *, static_batch: int = 0,
                 arrive_at_start: bool = True, on_step=None, stop_when_drained: bool = False):
        self.engine, self.requests, self.label = engine, requests, label
        self.driver = EngineDriver(engine, label)
        self.static_batch, self.arrive_at_start = static_batch, arrive_at_start
        self.on_step, self.stop_when_drained = on_step, stop_when_drained
        self.pending = list(range(len(requests)))
        self.clock = 0.0  # seconds of this engine's own work (wall clock of its own steps)
        self.cpu_clock = 0.0  # CPU seconds of this process during those steps: blind to other jobs' time slices
        self.wall_start = time.monotonic()
        self.peak_running = self.running_sum = 0
        self.stopped = False
        self.step_log: list[tuple[int, int, float]] = []  # (tokens, requests, seconds) per engine step

    @property
    def done(self) -> bool:
        return self.stopped or not (self.pending or self.engine.has_unfinished_requests())

    def advance(self) -> list:
        """Adds what has arrived, then runs one engine step; returns the keys that finished."""
        engine, driver = self.engine, self.driver
        started, cpu_started = time.perf_counter(), time.process_time()
        if self.static_batch:
            to_add = self.pending[:self.static_batch] if not engine.has_unfinished_requests() else []
        else:
            to_add = [i for i in self.pending if self.requests[i].get("at_step", 0) <= driver.steps]
        for i in to_add:
            request = self.requests[i]
            driver.add(i, request["prompt"], request["max_tokens"], arrival=0.0 if self.arrive_at_start else self.clock,
                       arrival_cpu=0.0 if self.arrive_at_start else self.cpu_clock)
        if to_add:
            added = set(to_add)
            self.pending = [i for i in self.pending if i not in added]
        if not engine.has_unfinished_requests():  # idle until a step-indexed arrival
            driver.steps += 1
            return []
        step = driver.step()
        outputs, stats = step.outputs, step.stats
        elapsed = time.perf_counter() - started
        self.clock += elapsed
        self.cpu_clock += time.process_time() - cpu_started
        self.step_log.append((stats.num_prefill_tokens + stats.num_decode_tokens, stats.num_seqs, elapsed))
        running = engine.stats().num_running + sum(1 for o in outputs if o.finished)  # as scheduled
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        if self.on_step is not None:
            self.on_step(engine, running)
        finished = driver.record(outputs, self.clock, self.cpu_clock)
        if self.stop_when_drained and not self.pending and engine.num_waiting == 0:
            for i, record in driver.records.items():
                if not record.finished:
                    driver.abort(i)
            self.stopped = True
        return finished

    def result(self) -> dict:
        records = []
        for i in range(len(self.requests)):
            record = self.driver.records.get(i)
            if record is None:
                records.append({"arrival": None, "token_times": [], "first_token_time": None, "num_output_tokens": 0,
                                "finish_reason": None, "num_cached_tokens": 0, "ttft": None, "itls": [],
                                "ttft_cpu": None, "itls_cpu": []})
                continue
            first, times, cpu_times = record.first_token_time, record.token_times, record.token_cpu_times
            records.append({
                "arrival": record.arrival, "token_times": times, "first_token_time": first,
                "num_output_tokens": record.num_output_tokens, "finish_reason": record.finish_reason,
                "num_cached_tokens": record.num_cached_tokens,
                "ttft": first - record.arrival if first is not None else None,
                "itls": [b - a for a, b in zip(times, times[1:], strict=False)],
                "ttft_cpu": cpu_times[0] - record.arrival_cpu if cpu_times and record.arrival_cpu is not None else None,
                "itls_cpu": [b - a for a, b in zip(cpu_times, cpu_times[1:], strict=False)],
            })
        stats = self.engine.stats()
        decode = [(t, n, d) for t, n, d in self.step_log if t == n]  # one token per request: pure decode
        mixed = [(t, n, d) for t, n, d in self.step_log if t != n]
        breakdown = {
            "decode_steps": len(decode), "decode_seconds": sum(d for _, _, d in decode),
            "decode_tokens": sum(t for t, _, _ in decode),
            "prefill_steps": len(mixed), "prefill_seconds": sum(d for _, _, d in mixed),
            "prefill_step_tokens": sum(t for t, _, _ in mixed),
        }
        return {"step_breakdown": breakdown, "records": records, "seconds": self.clock, "cpu_seconds": self.cpu_clock,
                "wall_seconds": time.monotonic() - self.wall_start, "steps": self.driver.steps,
                "output_tokens": self.driver.num_tokens, "peak_running": self.peak_running,
                "mean_running": self.running_sum / max(self.driver.steps, 1), "preemptions": stats.num_preemptions,
                "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits}


def interleave(sims: list[Sim], label: str, progress: Progress | None = None) -> list[dict]:
    """Advances the sims one step each in turn (the order flips every round) until all are done.

    ``progress`` (client.bench's) is fed the tokens and finished requests; by default one for this run.
    """
    if progress is None:
        with Progress(label, sum(len(sim.requests) for sim in sims), PROGRESS_INTERVAL_S) as own:
            return interleave(sims, label, own)
    round_index = 0
    while not all(sim.done for sim in sims):
        order = sims if round_index % 2 == 0 else list(reversed(sims))
        for sim in order:
            if not sim.done:
                tokens_before = sim.driver.num_tokens
                for _ in sim.advance():
                    progress.finish(failed=False)
                progress.add_tokens(sim.driver.num_tokens - tokens_before)
        round_index += 1
    return [sim.result() for sim in sims]


def drive(engine, requests: list[dict], label: str, progress: Progress | None = None, **kwargs) -> dict:
    """Runs one Sim alone to the end (see :class:`Sim`)."""
    return interleave([Sim(engine, requests, label, **kwargs)], label, progress)[0]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def print_table(header: list[str], rows: list[list]) -> None:
    print("\n| " + " | ".join(header) + " |")
    print("| --- | " + " | ".join("---:" for _ in header[1:]) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print(flush=True)


# ------------------------------------------------------------------------------------ ablations
def uniform(bounds: tuple[int, int]) -> str:
    return "uniform:{}:{}".format(*bounds)


def workload_of(builder: PromptBuilder, count: int, input_len: str, output_len: str, seed: int, **extra) -> list[dict]:
    """client.bench's workload as Sim requests (``extra``: shared_prefix, max_model_len)."""
    return [{"prompt": prompt, "max_tokens": max_tokens}
            for prompt, max_tokens in token_workload(builder, count, input_len, output_len, seed, **extra)]


def ablation_inflight(model_folder: str, builder: PromptBuilder, size: dict, seed: int) -> dict:
    """Continuous vs request-level static batching, same engine, same max_num_seqs = B."""
    batch = size["batch_size"]
    workload = workload_of(builder, size["num_requests"], uniform(size["prompt_range"]), uniform(size["output_range"]),
                           seed)
    overrides = {"max_num_seqs": str(batch)}
    # Two engines stepped alternately, each timed on its own clock: load changes hit both alike.
    modes = (("continuous", 0), ("static", batch))
    sims = [Sim(make_engine(model_folder, overrides, workload[0]["prompt"]), workload, f"inflight/{name}",
                static_batch=static)
            for name, static in modes]
    results = dict(zip([name for name, _ in modes], interleave(sims, "inflight"), strict=True))
    del sims
    rows = []
    summary = {}
    for name, result in results.items():
        ttfts = [r["ttft"] for r in result["records"]]
        tok_s = result["output_tokens"] / result["seconds"]
        tok_cpu_s = result["output_tokens"] / result["cpu_seconds"]
        summary[name] = {"step_breakdown": result["step_breakdown"],
                         "output_tokens": result["output_tokens"], "seconds": result["seconds"], "tokens_per_s": tok_s,
                         "cpu_seconds": result["cpu_seconds"], "tokens_per_cpu_s": tok_cpu_s,
                         "steps": result["steps"], "mean_running": result["mean_running"],
                         "ttft_p50_s": percentile(ttfts, 50), "num_finished": sum(1 for r in result["records"] if r["finish_reason"])}
        b = result["step_breakdown"]
        rows.append([name, result["output_tokens"], f"{result['seconds']:.1f}", f"{tok_s:.1f}", f"{tok_cpu_s:.1f}",
                     result["steps"],
                     f"{result['mean_running']:.1f}", ms(percentile(ttfts, 50)),
                     f"{b['decode_steps']} / {b['decode_seconds']:.1f} s / {b['decode_tokens']}",
                     f"{b['prefill_steps']} / {b['prefill_seconds']:.1f} s / {b['prefill_step_tokens']}"])
    print_table(["batching", "output tokens", "engine seconds", "output tok/s", "tok per CPU s", "steps", "mean running", "TTFT p50 ms",
                 "decode-only steps / s / tokens", "steps with prefill / s / tokens"], rows)
    ratio = summary["continuous"]["tokens_per_s"] / summary["static"]["tokens_per_s"]
    ratio_cpu = summary["continuous"]["tokens_per_cpu_s"] / summary["static"]["tokens_per_cpu_s"]
    return {"metric": "output tok/s, continuous / static", "ratio": ratio, "target": None, "results": summary,
            "ratio_cpu_time": ratio_cpu,
            "workload": {**size, "num_requests": len(workload), "output_tokens": sum(w["max_tokens"] for w in workload)},
            "overrides": overrides}


def ablation_prefix_caching(model_folder: str, builder: PromptBuilder, size: dict, seed: int) -> dict:
    """TTFT with prefix caching on vs off; requests one at a time, the two engines alternating."""
    workload = workload_of(builder, size["num_requests"], str(size["suffix_len"]), str(size["output_len"]), seed,
                           shared_prefix=SharedPrefix(size["num_system_prompts"], size["system_len"]))
    engines = {name: make_engine(model_folder, {"enable_prefix_caching": flag}, workload[0]["prompt"])
               for name, flag in (("caching on", "true"), ("caching off", "false"))}
    per_engine: dict[str, list[dict]] = {name: [] for name in engines}
    totals: dict[str, dict] = {name: {"seconds": 0.0, "steps": 0} for name in engines}
    with Progress("prefix_caching (both engines)", 2 * len(workload), PROGRESS_INTERVAL_S) as progress:
        for index, request in enumerate(workload):
            order = list(engines) if index % 2 == 0 else list(reversed(engines))  # alternate who goes first
            for name in order:
                result = drive(engines[name], [request], f"prefix/{name.replace(' ', '_')}/{index}", progress)
                per_engine[name].extend(result["records"])
                totals[name]["seconds"] += result["seconds"]
                totals[name]["steps"] += result["steps"]
    summary, rows = {}, []
    for name, engine in engines.items():
        stats = engine.stats()
        ttfts = [r["ttft"] for r in per_engine[name]]
        ttfts_cpu = [r["ttft_cpu"] for r in per_engine[name]]
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        summary[name] = {"ttfts_s": ttfts, "ttfts_cpu_s": ttfts_cpu, "ttft_cpu_p50_s": percentile(ttfts_cpu, 50),
                         "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
                         "ttft_mean_s": sum(ttfts) / len(ttfts), "prefix_cache_queries": stats.prefix_cache_queries,
                         "prefix_cache_hits": stats.prefix_cache_hits, "hit_rate": hit_rate,
                         "num_finished": sum(1 for r in per_engine[name] if r["finish_reason"]),
                         "output_tokens": sum(r["num_output_tokens"] for r in per_engine[name]),
                         "cached_tokens": sum(r["num_cached_tokens"] for r in per_engine[name]), **totals[name]}
        rows.append([name, len(ttfts), ms(summary[name]["ttft_p50_s"]), ms(summary[name]["ttft_p90_s"]),
                     ms(summary[name]["ttft_mean_s"]), ms(summary[name]["ttft_cpu_p50_s"]), f"{hit_rate:.1%}",
                     summary[name]["cached_tokens"]])
    print_table(["prefix caching", "requests", "TTFT p50 ms", "TTFT p90 ms", "TTFT mean ms", "TTFT p50 CPU ms", "hit rate (tokens)",
                 "cached prompt tokens"], rows)
    ratio = summary["caching off"]["ttft_p50_s"] / summary["caching on"]["ttft_p50_s"]
    ratio_cpu = summary["caching off"]["ttft_cpu_p50_s"] / summary["caching on"]["ttft_cpu_p50_s"]
    return {"metric": "TTFT p50, off / on", "ratio": ratio, "target": 3.0, "results": summary,
            "ratio_cpu_time": ratio_cpu,
            "hit_rate": summary["caching on"]["hit_rate"],
            "workload": {**size, "prompt_tokens": sum(len(w["prompt"]) for w in workload)}}


def ablation_chunked_prefill(model_folder: str, builder: PromptBuilder, size: dict, seed: int) -> dict:
    """ITL of running decodes when long prompts arrive, chunked prefill on vs off."""
    decoders = [dict(request, at_step=0) for request in workload_of(
        builder, size["num_decoders"], uniform(size["decoder_prompt_range"]), str(size["decoder_output_len"]), seed)]
    longs = [dict(request, at_step=step) for request, step in zip(workload_of(
        builder, len(size["long_arrival_steps"]), str(size["long_prompt_len"]), str(size["long_output_len"]), seed + 1),
        size["long_arrival_steps"], strict=True)]
    workload = decoders + longs
    max_len = size["max_model_len"]
    configs = {
        "chunked on": {"max_model_len": str(max_len), "max_num_batched_tokens": str(size["chunk_budget"]),
                       "enable_chunked_prefill": "true"},
        "chunked off": {"max_model_len": str(max_len), "max_num_batched_tokens": str(max_len),
                        "enable_chunked_prefill": "false"},
    }
    sims = [Sim(make_engine(model_folder, overrides, workload[0]["prompt"]), workload, f"chunked/{name.replace(' ', '_')}",
                arrive_at_start=False) for name, overrides in configs.items()]
    results = dict(zip(configs, interleave(sims, "chunked_prefill"), strict=True))
    del sims
    summary, rows = {}, []
    for name, overrides in configs.items():
        result = results[name]
        decode_records = result["records"][:len(decoders)]
        long_records = result["records"][len(decoders):]
        itls = [itl for r in decode_records for itl in r["itls"]]
        itls_cpu = [itl for r in decode_records for itl in r["itls_cpu"]]
        long_ttfts = [r["ttft"] for r in long_records]
        summary[name] = {"itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99), "itl_max_s": max(itls),
                         "itl_cpu_p99_s": percentile(itls_cpu, 99),
                         "num_itls": len(itls), "long_ttft_p50_s": percentile(long_ttfts, 50),
                         "seconds": result["seconds"], "steps": result["steps"], "output_tokens": result["output_tokens"],
                         "num_finished": sum(1 for r in result["records"] if r["finish_reason"]),
                         "overrides": overrides}
        s = summary[name]
        rows.append([name, overrides["max_num_batched_tokens"], s["num_itls"], ms(s["itl_p50_s"]), ms(s["itl_p99_s"]),
                     ms(s["itl_max_s"]), ms(s["itl_cpu_p99_s"]), ms(s["long_ttft_p50_s"]), result["steps"], f"{result['seconds']:.1f}"])
    print_table(["prefill", "token budget", "decode ITLs", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "ITL p99 CPU ms",
                 "long-prompt TTFT p50 ms", "steps", "engine seconds"], rows)
    ratio = summary["chunked off"]["itl_p99_s"] / summary["chunked on"]["itl_p99_s"]
    ratio_cpu = summary["chunked off"]["itl_cpu_p99_s"] / summary["chunked on"]["itl_cpu_p99_s"]
    return {"metric": "decode ITL p99, off / on", "ratio": ratio, "target": 2.0, "results": summary,
            "ratio_cpu_time": ratio_cpu,
            "workload": {**size, "num_requests": len(workload)}}


def ablation_paged_kv(model_folder: str, builder: PromptBuilder, size: dict, seed: int) -> dict:
    """Concurrent requests in a K-block pool: paging (measured) vs max_model_len reservation (computed)."""
    max_len = size["max_model_len"]
    # Chat-like lengths: lognormal around the medians with long tails, clipped to fit max_model_len.
    workload = workload_of(builder, size["num_requests"], f"lognormal:{size['prompt_median']}:0.8:4:{max_len * 3 // 4}",
                           f"lognormal:{size['output_median']}:0.7:2:{max_len}", seed, max_model_len=max_len)
    lengths = [(len(w["prompt"]), w["max_tokens"]) for w in workload]
    usable = size["num_blocks"]
    overrides = {"num_kv_blocks": str(usable + 1), "max_model_len": str(size["max_model_len"]),
                 "max_num_seqs": str(max(256, size["num_requests"])), "enable_prefix_caching": "false"}
    engine = make_engine(model_folder, overrides, workload[0]["prompt"])
    block_size = engine.config.cache.block_size
    runner = engine.model_runner
    bytes_per_block = runner.shape.kv_cache_bytes_per_block(block_size, runner.dtype)
    saturated = []  # num_running in steps where requests still waited for room

    def on_step(eng, running):
        if eng.num_waiting:
            saturated.append(running)

    result = drive(engine, workload, "paged_kv", on_step=on_step, stop_when_drained=True)
    del engine
    paged_peak = result["peak_running"]
    paged_saturated = sum(saturated) / len(saturated) if saturated else float(paged_peak)
    contiguous = usable * block_size // size["max_model_len"]
    mean_blocks = sum(ceil_div(p + o, block_size) for p, o in lengths) / len(lengths)
    summary = {
        "num_blocks": usable, "block_size": block_size, "kv_bytes": usable * bytes_per_block,
        "max_model_len": size["max_model_len"], "contiguous_capacity": contiguous, "paged_peak_running": paged_peak,
        "paged_mean_running_saturated": paged_saturated, "paged_final_length_capacity": usable / mean_blocks,
        "mean_prompt_tokens": sum(p for p, _ in lengths) / len(lengths),
        "mean_output_tokens": sum(o for _, o in lengths) / len(lengths), "preemptions": result["preemptions"],
        "seconds": result["seconds"], "steps": result["steps"], "output_tokens": result["output_tokens"],
        "num_finished": sum(1 for r in result["records"] if r["finish_reason"] and not r["finish_reason"].startswith("abort")),
        "num_stopped": sum(1 for r in result["records"] if (r["finish_reason"] or "").startswith("abort")),
    }
    mib = summary["kv_bytes"] / 2**20
    rows = [
        ["contiguous (max_model_len reserved)", f"{contiguous}", f"{usable} x {block_size} tokens ({mib:.0f} MiB)",
         f"{usable * block_size} // {size['max_model_len']}"],
        ["paged, peak num_running (measured)", f"{paged_peak}", "same", f"{result['preemptions']} preemptions"],
        ["paged, mean num_running while queue non-empty", f"{paged_saturated:.1f}", "same", f"{len(saturated)} steps"],
        ["paged, pool / mean final-length blocks (computed)", f"{usable / mean_blocks:.1f}", "same",
         f"mean {mean_blocks:.1f} blocks/request"],
    ]
    print_table(["KV layout", "concurrent requests", "KV pool", "note"], rows)
    ratio = paged_peak / contiguous if contiguous else float("inf")
    return {"metric": "concurrent requests, paged peak / contiguous", "ratio": ratio, "target": 3.0,
            "ratio_mean_saturated": paged_saturated / contiguous if contiguous else float("inf"),
            "results": summary, "workload": {**size, "output_tokens": sum(o for _, o in lengths)},
            "overrides": overrides}


RUNNERS = {"inflight": ablation_inflight, "prefix_caching": ablation_prefix_caching,
           "chunked_prefill": ablation_chunked_prefill, "paged_kv": ablation_paged_kv}


def run_ablations(names, model_folder: str, smoke: bool = False, seed: int = 0) -> dict:
    builder = prompt_builder(engine_config_from_model_folder(model_folder))
    sizes = SIZES["smoke" if smoke else "full"]
    ablations = {}
    for name in names:
        print(f"\n## {name}", flush=True)
        start = time.perf_counter()
        ablations[name] = RUNNERS[name](model_folder, builder, sizes[name], seed)
        ablations[name]["wall_s"] = time.perf_counter() - start
        target = ablations[name]["target"]
        ablations[name]["met"] = None if target is None else ablations[name]["ratio"] >= target
    return ablations


def print_summary(ablations: dict) -> None:
    rows = []
    for name, result in ablations.items():
        target = result["target"]
        met = "n/a" if target is None else ("yes" if result["met"] else "**no**")
        cpu = result.get("ratio_cpu_time")
        rows.append([name, result["metric"], f"{result['ratio']:.2f}x", "-" if cpu is None else f"{cpu:.2f}x",
                     "report only" if target is None else f">= {target:g}x",
                     met, f"{result['wall_s']:.0f} s"])
    print("\n## summary")
    print_table(["ablation", "metric", "ratio", "ratio on CPU time", "target", "met", "wall"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.ablations", description=__doc__.splitlines()[0])
    add_model_folder_argument(parser)
    parser.add_argument("--only", choices=ABLATIONS, action="append", default=None,
                        help="run only this ablation (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (seconds): checks the plumbing, not the ratios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args(argv)

    names = args.only or list(ABLATIONS)
    started = datetime.datetime.now(datetime.UTC)
    ablations = run_ablations(names, args.model_folder, smoke=args.smoke, seed=args.seed)
    print_summary(ablations)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "backend", "models", "model_repository"],
                           cwd=REPO_ROOT, capture_output=True, text=True).stdout.split("\n")

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    record = {"ablations": ablations, "commit": commit,
              "uncommitted_engine_files": [line[3:] for line in dirty if line.strip()], "date": started.isoformat(timespec="seconds"),
              "command": "python -m perf.ablations " + " ".join(argv if argv is not None else sys.argv[1:]),
              "smoke": args.smoke, "seed": args.seed,
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform(), "loadavg_end": load},
              "config": str(engine_config_from_model_folder(args.model_folder))}
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(record, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
