"""TTFT of a long shared prefix evicted from the pool: loaded from the KV offload tier against
recomputed, and the same after a restart (issue 19).

One run, the systems side by side on the same machine: an engine without a tier (recomputes),
one with the disk tier (``kv_offload_load_policy`` auto: the cost rule decides, and what it
decided is reported), and one with the host tier for reference (on a CPU it only copies memory to
memory). Each trial evicts the prefix from every engine's pool with filler prompts, then times one
request of prefix + a new question from submission to its first token (engine level: this is the
prefill or load the tier saves, without Triton's constant overhead). The restart rows close each
engine (a disk tier writes the prefixes still in its pool at shutdown), start a new one on the
same folder and time the first request. Page cache: the disk tier's files are read back through
the OS page cache when they are still in it (say so with the numbers: ``--drop-caches`` tries to
empty it first, which needs root).

    python -m perf.kv_offload [--prefix-tokens 2000] [--trials 5]

``--served`` asks the same question of a running tritonserver, the way issue 56 found the disk
tier's restore regressed: the served `llm` model with the disk tier (policy as given, the token
budget of its config.pbtxt), a pool that holds one prompt of ``--prefix-tokens`` but not two, one
request at a time with max_tokens 1: a new prompt P (computed), three other prompts of that length
that evict it (spilled to disk), then P again (restored or recomputed, as the cost rule decides),
per trial; time to the answer, client side, and the restored and recomputed block counters.

    python -m perf.kv_offload --served [--prefix-tokens 1400] [--trials 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from client.bench.prompts import PromptBuilder
from client.bench.workload import SharedPrefix
from client.stream import StreamingClient
from perf import engine_driver
from perf.compare.histogram import model_values
from perf.served import RESULTS_DIR, tritonserver, write_report

SYSTEMS = ("recompute", "disk tier", "host tier")
TIERS = {"recompute": "none", "disk tier": "disk", "host tier": "host"}


def build(model_folder: str, system: str, offload_dir: str, num_blocks: int, policy: str) -> LLMEngine:
    overrides = {"num_kv_blocks": str(num_blocks), "kv_offload_tier": TIERS[system],
                 "kv_offload_dir": offload_dir, "kv_offload_load_policy": policy, "kv_offload_bytes": str(4 << 30)}
    return LLMEngine(engine_config_from_model_folder(model_folder, **overrides))


def ttft(engine: LLMEngine, label: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from submission to the first token, and the first 8 greedy tokens (a parity check)."""
    (record,) = engine_driver.run(engine, [(prompt, 8)], label=label).records
    return record.ttft, record.token_ids


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_driver.add_model_folder_argument(parser)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--policy", default="auto", choices=("auto", "always"))
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before each disk load (root)")
    parser.add_argument("--served", action="store_true", help="through tritonserver (see the docstring)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    return served_main(args, argv) if args.served else engine_main(args, argv)


def engine_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The engine-level measurement (module docstring): the three systems, alternating, then restarts."""
    block_size = 16
    num_blocks = (args.prefix_tokens + 600) // block_size  # the prefix and one filler: a filler evicts it
    work = Path(tempfile.mkdtemp(prefix="kv-offload-bench-"))
    offload_dir = str(work / "tier")
    engines = {s: build(args.model_folder, s, offload_dir + ("-host" if s == "host tier" else ""), num_blocks, args.policy) for s in SYSTEMS}
    meta = engines["recompute"].model_runner
    # client.bench's workload on the model's tokenizer (the prompts' content does not matter here):
    # the shared prefix + a new 20-token question per trial (the first warms the pools, the last is
    # asked after the restart), and fillers that evict the prefix from a pool.
    builder = engine_driver.prompt_builder(engines["recompute"].config)
    asked = [prompt for prompt, _ in engine_driver.token_workload(
        builder, args.trials + 2, "20", "8", 19, SharedPrefix(1, args.prefix_tokens))]
    fillers = [prompt for prompt, _ in engine_driver.token_workload(
        builder, args.trials, str(num_blocks * block_size - 2 * block_size), "8", 20)]
    print(f"model {meta.shape.num_layers} layers, dtype {meta.dtype}, pool {num_blocks} blocks of {block_size}; "
          f"prefix {args.prefix_tokens} tokens; {args.trials} trials", flush=True)
    dropped: list[bool] = []
    times, first_tokens = alternating_trials(args, engines, asked, fillers, dropped)
    decisions = {s: (e.offloader.stats.restored_blocks, e.offloader.stats.recomputed_blocks)
                 for s, e in engines.items() if e.offloader is not None}
    rates = {s: (e.offloader.read_bytes_per_second, e.offloader.prefill_tokens_per_second)
             for s, e in engines.items() if e.offloader is not None}
    model_name, dtype = Path(engines["recompute"].config.model.model_dir).name, meta.dtype
    restart, restart_tokens = restarts(args, engines, offload_dir, num_blocks, asked[-1], dropped)
    same = all(first_tokens[s] == first_tokens["recompute"] for s in SYSTEMS) and \
        restart_tokens["disk tier"] == restart_tokens["recompute"]
    markdown = engine_markdown(args, argv, f"{model_name}, {dtype}", times, restart, decisions, rates, same, dropped)
    document = {"prefix_tokens": args.prefix_tokens, "trials": args.trials, "policy": args.policy,
                "ttft_seconds": times, "restart_ttft_seconds": restart, "decisions": decisions,
                "same_tokens": same, "page_cache_dropped": bool(dropped and all(dropped)), "num_blocks": num_blocks,
                "dtype": str(dtype), "threads": os.cpu_count()}
    out = Path(args.out_dir) if args.out_dir else RESULTS_DIR / "kv_offload" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    write_report(out, "kv_offload", document, markdown)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


def alternating_trials(args, engines: dict[str, LLMEngine], asked: list[list[int]], fillers: list[list[int]],
                       dropped: list[bool]) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Per trial and system: a filler evicts the prefix, then the prefix + a new question is timed."""
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    first_tokens: dict[str, list[list[int]]] = {s: [] for s in SYSTEMS}
    for system, engine in engines.items():  # warm-up: the prefix once, into every pool (and tier)
        ttft(engine, f"warm-{system}", asked[0])
    for trial in range(args.trials):
        for system, engine in engines.items():  # alternating systems within each trial
            ttft(engine, f"fill-{trial}-{system}", fillers[trial])  # evicts the prefix (spilled to the tier)
            if engine.offloader is not None:
                engine.offloader.flush()
            if system == "disk tier" and args.drop_caches:
                dropped.append(drop_page_cache())
            seconds, tokens = ttft(engine, f"t{trial}-{system}", asked[1 + trial])
            times[system].append(seconds)
            first_tokens[system].append(tokens)
        print(f"trial {trial + 1}/{args.trials}: " + ", ".join(f"{s} {times[s][-1] * 1000:.0f} ms" for s in SYSTEMS),
              flush=True)
    return times, first_tokens


def restarts(args, engines: dict[str, LLMEngine], offload_dir: str, num_blocks: int, prompt: list[int],
             dropped: list[bool]) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Closes every engine (the disk tier keeps the pool's prefixes); a new recompute and disk-tier
    engine on the same folder each time their first request."""
    restart: dict[str, float] = {}
    restart_tokens: dict[str, list[int]] = {}
    for system in ("recompute", "disk tier"):
        engines.pop(system).close()
        if system == "disk tier" and args.drop_caches:
            dropped.append(drop_page_cache())
        engine = build(args.model_folder, system, offload_dir, num_blocks, args.policy)
        restart[system], restart_tokens[system] = ttft(engine, f"restart-{system}", prompt)
        restored = engine.offloader.stats.restored_blocks if engine.offloader is not None else 0
        print(f"after a restart: {system} {restart[system] * 1000:.0f} ms ({restored} blocks restored)", flush=True)
        engine.close()
    engines.pop("host tier").close()
    return restart, restart_tokens


def engine_markdown(args, argv, model: str, times, restart, decisions, rates, same: bool, dropped: list[bool]) -> str:
    p50 = {s: statistics.median(v) for s, v in times.items()}
    rows = [f"| {s} | {p50[s] * 1000:.0f} | {min(times[s]) * 1000:.0f} | {max(times[s]) * 1000:.0f} | "
            f"{p50['recompute'] / p50[s]:.1f}x |" for s in SYSTEMS]
    rows += [f"| after a restart: {s} | {restart[s] * 1000:.0f} | | | {restart['recompute'] / restart[s]:.1f}x |"
             for s in restart]
    page_cache = ("page cache dropped before each disk load" if dropped and all(dropped)
                  else "disk files read through the OS page cache (not dropped)")
    return "\n".join([
        f"KV offload: TTFT of a {args.prefix_tokens}-token shared prefix evicted from the pool "
        f"(engine level, {model}, {args.trials} trials, policy {args.policy}; {page_cache})",
        "",
        "| system | TTFT p50 ms | min | max | recompute / system |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        "cost rule (restored blocks, recomputed blocks): "
        + ", ".join(f"{s} {v}" for s, v in decisions.items())
        + "; measured read MB/s and prefill tok/s: "
        + ", ".join(f"{s} {r / 1e6:.0f} MB/s, {p:.0f} tok/s" for s, (r, p) in rates.items()),
        f"greedy tokens equal across systems: {same}",
        "",
        f"command: python -m perf.kv_offload {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
    ])


def served_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The --served measurement (module docstring): per trial, P computed, then P restored."""
    config = engine_config_from_model_folder(args.model_folder)
    block_size = config.cache.block_size
    num_blocks = (args.prefix_tokens * 3 // 2) // block_size  # one prompt fits, two do not
    builder = PromptBuilder(config.model.tokenizer_dir or config.model.model_dir)
    rng = np.random.default_rng(56)
    work = Path(tempfile.mkdtemp(prefix="kv-offload-served-"))
    overrides = {"num_kv_blocks": str(num_blocks), "kv_offload_tier": "disk", "kv_offload_dir": str(work / "tier"),
                 "kv_offload_bytes": str(4 << 30), "kv_offload_load_policy": args.policy}
    counters = ("llm_kv_offload_restored_blocks_total", "llm_kv_offload_recomputed_blocks_total")
    rows, computed, restored_seconds = [], [], []
    print(f"{Path(config.model.model_dir).name}, pool {num_blocks} blocks of {block_size}, prompts of "
          f"{args.prefix_tokens} tokens, budget {config.scheduler.max_num_batched_tokens}", flush=True)
    with tritonserver(Path(args.model_folder).parent, overrides, model=Path(args.model_folder).name) as server, \
            StreamingClient(server.grpc_url, "llm") as client:
        def seconds(prompt: str) -> float:
            start = time.perf_counter()
            result = client.generate(prompt, max_tokens=1, timeout=300)
            if result.error is not None:
                raise RuntimeError(result.error)
            return time.perf_counter() - start

        seconds(builder.prompt(16, rng))
        for trial in range(args.trials):
            asked = builder.prompt(args.prefix_tokens, rng)
            computed.append(seconds(asked))
            for _ in range(3):
                seconds(builder.prompt(args.prefix_tokens, rng))
            before = model_values(server.metrics_url, counters)
            restored_seconds.append(seconds(asked))
            after = model_values(server.metrics_url, counters)
            restored, recomputed = (after.get(name, 0.0) - before.get(name, 0.0) for name in counters)
            rows.append(f"| {trial + 1} | {computed[-1] * 1000:.0f} | {restored_seconds[-1] * 1000:.0f} | "
                        f"{computed[-1] / restored_seconds[-1]:.1f}x | {restored:.0f} | {recomputed:.0f} |")
            print(rows[-1], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(computed) / statistics.median(restored_seconds)
    markdown = "\n".join([
        f"KV offload through tritonserver: P computed, evicted to the disk tier by 3 prompts, asked again "
        f"({Path(config.model.model_dir).name}, {config.model.dtype}, {args.prefix_tokens}-token prompts, policy "
        f"{args.policy}, pool {num_blocks} blocks, budget {config.scheduler.max_num_batched_tokens})",
        "",
        "| trial | computed ms | again ms | ratio | blocks restored | blocks recomputed |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"medians: computed {statistics.median(computed) * 1000:.0f} ms, again "
        f"{statistics.median(restored_seconds) * 1000:.0f} ms: {ratio:.1f}x",
        f"command: python -m perf.kv_offload {' '.join(sys.argv[1:] if argv is None else argv)}",
    ])
    out = Path(args.out_dir) if args.out_dir else (
        RESULTS_DIR / "kv_offload_served" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    write_report(out, "kv_offload_served", {"computed_seconds": computed, "again_seconds": restored_seconds,
                                            "ratio_of_medians": ratio, "prefix_tokens": args.prefix_tokens,
                                            "num_blocks": num_blocks, "policy": args.policy}, markdown)
    return 0



if __name__ == "__main__":
    sys.exit(main())
