"""Mixture of experts against vLLM CPU, and what a sliding window costs (issue 35).

    .venv/bin/python -m perf.moe_bench [--part vllm,window,window-memory] [--repeat 3] [--num-requests 32]
        [--dtype float32]

``vllm``: a random Qwen3-MoE checkpoint about SmolLM2-135M's size in active parameters (its
hidden size, layers, heads and vocabulary; 8 experts of half its MLP width, top 2, so a token runs
as many MLP weights as SmolLM2's) with SmolLM2's tokenizer, built once into
``models/qwen3-moe-smol``; then ``perf.compare --systems engine,vllm`` on a model repository copy
serving it (both systems on the same folder and prompts, alternating ``--repeat`` times, vLLM in
its default and tuned setups, medians; ``--dtype`` for both).

``window``: a Gemma 3 layout of the same size (five sliding layers of ``--window`` positions to
one global, transformers' default pattern) against the same weights with every layer global,
in-process, long prompts (``--window-input-len``), the two alternating per round: output tokens/s,
TTFT p50 and step time, medians.

``window-memory``: a Mistral layout of the same size (every layer a ``--window`` sliding window)
in a KV pool that holds ``--memory-pool-requests`` requests at full length, ``--window-requests``
long requests at once; blocks the window has passed given back (as served) against every block
kept (the manager's window set to 0, a measuring baseline only), alternating: output tokens/s,
TTFT p50, preemptions and the most requests running at once, medians.

Results: perf/results/moe/ (json) and the tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from backend.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from backend.engine.llm_engine import LLMEngine
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.report import write_json
from perf.compare.repository import repository_with_overrides
from perf.engine_driver import prompt_builder, run, token_workload, warm_up

SMOLLM2 = REPO_ROOT / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")
RESULTS = REPO_ROOT / "perf" / "results" / "moe"


def smollm2_shape() -> dict:
    config = json.loads((SMOLLM2 / "config.json").read_text())
    return {key: config[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                                         "bos_token_id", "eos_token_id")} | {"intermediate": config["intermediate_size"]}


def save_random(model_cls, config, out: Path) -> Path:
    """A seeded random checkpoint with SmolLM2's tokenizer beside it (made once)."""
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config.initializer_range = 0.05
    model_cls(config).to(torch.bfloat16).save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (SMOLLM2 / name).exists():
            shutil.copy(SMOLLM2 / name, out / name)
    return out


def build_moe(out: Path) -> Path:
    shape = smollm2_shape()
    inter = shape.pop("intermediate")
    config = Qwen3MoeConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                            intermediate_size=inter, moe_intermediate_size=inter // 2, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=8192)
    return save_random(Qwen3MoeForCausalLM, config, out)


def build_gemma(out: Path, window: int, sliding: bool) -> Path:
    shape = smollm2_shape()
    inter = shape.pop("intermediate")
    layers = shape["num_hidden_layers"]
    types = [("sliding_attention" if sliding and (i + 1) % 6 else "full_attention") for i in range(layers)]
    config = Gemma3TextConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                              intermediate_size=inter, sliding_window=window, layer_types=types,
                              max_position_embeddings=8192, pad_token_id=0)
    return save_random(Gemma3ForCausalLM, config, out)


def build_mistral(out: Path, window: int) -> Path:
    shape = smollm2_shape()
    inter = shape.pop("intermediate")
    config = MistralConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                           intermediate_size=inter, sliding_window=window, max_position_embeddings=8192)
    return save_random(MistralForCausalLM, config, out)


def part_vllm(args) -> None:
    folder = build_moe(REPO_ROOT / "models" / "qwen3-moe-smol")
    with tempfile.TemporaryDirectory(prefix="moe-repo-") as tmp:
        repo = repository_with_overrides(REPO_ROOT / "model_repository", "llm",
                                         {"model_dir": str(folder), "tokenizer_dir": str(folder)}, Path(tmp))
        command = [sys.executable, "-m", "perf.compare", "--model-repository", str(repo), "--systems", "engine,vllm",
                   "--num-requests", str(args.num_requests), "--repeat", str(args.repeat), "--dtype", args.dtype,
                   "--out-dir", str(RESULTS / ("compare" if args.dtype == "float32" else f"compare-{args.dtype}"))]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=REPO_ROOT)


def engine_for(folder: Path, max_model_len: int, num_kv_blocks: int = 0, max_num_batched_tokens: int = 2048,
               ) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=str(folder), tokenizer_dir=str(folder), dtype="float32", device="cpu",
                          max_model_len=max_model_len),
        cache=CacheConfig(block_size=16, kv_cache_memory_mb=4096, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens),
    ))


def measure(engine: LLMEngine, requests, on_step=None) -> dict:
    """Every request at once: output tokens/s, TTFT p50 and the median gap between tokens."""
    work = [(prompt, SamplingParams(max_tokens=length, ignore_eos=True)) for prompt, length in requests]
    result = run(engine, work, on_step=on_step)
    records = result.records
    gaps = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    return {"output_tokens_per_s": sum(r.num_output_tokens for r in records) / result.duration_s,
            "ttft_p50_ms": 1000 * statistics.median(r.token_times[0] - r.arrival for r in records),
            "itl_p50_ms": 1000 * statistics.median(gaps)}


def alternate(engines: dict[str, LLMEngine], requests, repeat: int, measure_one=measure) -> tuple[dict, dict]:
    """Every engine warmed up, then ``repeat`` rounds of each in turn: the runs and their medians."""
    for engine in engines.values():
        warm_up(engine, requests[0][0])
    samples: dict[str, list[dict]] = {name: [] for name in engines}
    for round_index in range(repeat):
        for name, engine in engines.items():
            summary = measure_one(engine, requests)
            samples[name].append(summary)
            print(f"round {round_index + 1}/{repeat} {name}: "
                  + ", ".join(f"{key} {value:.1f}" for key, value in summary.items()), flush=True)
    table = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in samples.items()}
    return samples, table


def part_window(args) -> dict:
    root = REPO_ROOT / "models"
    folders = {"sliding": build_gemma(root / f"gemma3-smol-w{args.window}", args.window, True),
               "global": build_gemma(root / "gemma3-smol-global", args.window, False)}
    max_model_len = 4096
    engines = {name: engine_for(folder, max_model_len) for name, folder in folders.items()}
    builder = prompt_builder(engines["sliding"].config)
    requests = token_workload(builder, args.window_requests, args.window_input_len, args.window_output_len, seed=1)
    samples, table = alternate(engines, requests, args.repeat)
    print(f"\n| layout (window {args.window}, {args.window_input_len} in / {args.window_output_len} out, "
          f"{args.window_requests} requests) | output tok/s | TTFT p50 ms | ITL p50 ms |\n|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['output_tokens_per_s']:.1f} | {row['ttft_p50_ms']:.0f} | {row['itl_p50_ms']:.1f} |")
    return {"table": table, "runs": samples}


def measure_held(engine: LLMEngine, requests) -> dict:
    """``measure`` plus the run's preemptions and the most requests running at once."""
    preemptions = engine.stats().num_preemptions
    running = [0]
    summary = measure(engine, requests, on_step=lambda _: running.append(len(engine.scheduler.running)))
    return summary | {"preemptions": engine.stats().num_preemptions - preemptions, "most_running": max(running)}


def part_window_memory(args) -> dict:
    folder = build_mistral(REPO_ROOT / "models" / f"mistral-smol-w{args.window}", args.window)
    input_len, output_len = int(args.window_input_len), int(args.window_output_len)
    full_length_blocks = -(-(input_len + output_len) // 16)
    num_blocks = args.memory_pool_requests * full_length_blocks + 1
    engines = {"window frees": engine_for(folder, 4096, num_blocks, args.memory_chunk),
               "every block kept": engine_for(folder, 4096, num_blocks, args.memory_chunk)}
    engines["every block kept"].kv_cache_manager.sliding_window = 0  # the baseline: nothing given back
    builder = prompt_builder(engines["window frees"].config)
    requests = token_workload(builder, args.window_requests, args.window_input_len, args.window_output_len, seed=1)
    samples, table = alternate(engines, requests, args.repeat, measure_held)
    print(f"\n| Mistral layout (window {args.window}, {input_len} in / {output_len} out, {args.window_requests} "
          f"requests, {num_blocks} blocks of 16) | output tok/s | TTFT p50 ms | ITL p50 ms | preemptions | "
          "most running |\n|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['output_tokens_per_s']:.1f} | {row['ttft_p50_ms']:.0f} | {row['itl_p50_ms']:.1f} | "
              f"{row['preemptions']:.0f} | {row['most_running']:.0f} |")
    return {"table": table, "runs": samples, "num_kv_blocks": num_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="vllm,window")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the vllm part's dtype")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--window-requests", type=int, default=8)
    parser.add_argument("--window-input-len", default="3072")
    parser.add_argument("--window-output-len", default="32")
    parser.add_argument("--memory-pool-requests", type=int, default=2,
                        help="window-memory: the pool holds this many requests at full length")
    parser.add_argument("--memory-chunk", type=int, default=512, help="window-memory: max_num_batched_tokens")
    args = parser.parse_args()
    parts = args.part.split(",")
    if "vllm" in parts:
        part_vllm(args)
    if "window" in parts:
        result = part_window(args)
        RESULTS.mkdir(parents=True, exist_ok=True)
        write_json({"when": now_iso(), "git": git_state(), "machine": machine_info(), "settings": vars(args),
                    "dtype": "float32", **result}, RESULTS / "window.json")
    if "window-memory" in parts:
        result = part_window_memory(args)
        RESULTS.mkdir(parents=True, exist_ok=True)
        write_json({"when": now_iso(), "git": git_state(), "machine": machine_info(), "settings": vars(args),
                    "dtype": "float32", **result}, RESULTS / "window_memory.json")


if __name__ == "__main__":
    main()
