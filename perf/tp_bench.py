"""Step time at tensor_parallel_size 1 and 2 on this machine, with the communication's share.

Size 1 is one rank of as many torch threads as this process may use; size 2 is two ranks of one
thread each, each pinned to its own core (backend/parallel/group.py), with the collectives in shared
memory (backend/parallel/shm.py, the default) and, as ``2-gloo``, through gloo alone. The same engine runs in this
process (rank 0) for each size in turn, sizes alternating within every round; the table gives the
median over rounds of: a decode step's time at batch 1, 16 and 64 (128-token contexts), and the
time of a step that prefills one 512-token prompt. The communication's share is the time rank 0
spent in collectives during those steps (waiting for the other rank included) over the step time.

Models: the demo model (8 query / 2 KV heads), and a random Llama of SmolLM2's size with 8 heads
instead of 9 (SmolLM2's 9 heads split only 3 ways), written by transformers into a temporary folder.

    python -m perf.tp_bench [--rounds 3] [--models demo,smol8] [--systems 1,2,2-gloo] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backend.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from backend.engine.llm_engine import LLMEngine
from backend.models.demo_model import DEFAULT_OUT as DEMO_DIR
from backend.models.demo_model import build as build_demo
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.report import write_json

DECODE_BATCHES = (1, 16, 64)
CONTEXT = 128
PREFILL = 512
DECODE_STEPS = 12  # measured decode steps per batch size (after the prefill steps)


def smol8_folder(root: str) -> str:
    """A random Llama with SmolLM2-135M's dimensions but 8 query / 2 KV heads of 64."""
    folder = os.path.join(root, "smol8")
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def engine_for(folder: str, system: str, dtype: str) -> LLMEngine:
    size = int(system.split("-")[0])
    if system.endswith("-gloo"):  # no shared-memory file: every collective goes through gloo
        with mock.patch("backend.parallel.shm.create_file", return_value=None):
            return engine_for(folder, str(size), dtype)
    return LLMEngine(EngineConfig(
        model=ModelConfig(model_dir=folder, tokenizer_dir=str(DEMO_DIR), dtype=dtype, device="cpu",
                          max_model_len=1024, tensor_parallel_size=size),
        cache=CacheConfig(block_size=16, num_kv_blocks=64 * (CONTEXT + DECODE_STEPS + 48) // 16 + 64,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=PREFILL, default_max_tokens=16),
    ))


def timed_steps(engine: LLMEngine) -> list[tuple[float, float, int, int]]:
    """Steps the engine until idle: (seconds, collective seconds, prefill tokens, decode tokens) per step."""
    clock = engine.model_runner.model.shard.collective_seconds
    steps = []
    while engine.has_unfinished_requests():
        before, start = clock[0], time.perf_counter()
        step = engine.step()
        steps.append((time.perf_counter() - start, clock[0] - before, step.stats.num_prefill_tokens,
                      step.stats.num_decode_tokens))
    return steps


def measure(engine: LLMEngine, vocab: int, rng: random.Random) -> dict[str, tuple[float, float]]:
    """{case: (median step ms, communication share)}."""
    found = {}
    engine.generate([[rng.randrange(3, vocab) for _ in range(64)]], SamplingParams(max_tokens=4, ignore_eos=True))
    for batch in DECODE_BATCHES:
        # the first requests decode while the last ones still prefill: enough tokens that all decode together
        max_tokens = DECODE_STEPS + batch * CONTEXT // PREFILL + 2
        for index in range(batch):
            engine.add_request(f"d{batch}-{index}", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(CONTEXT)],
                               sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        decodes = [(s, c) for s, c, prefill, decode in timed_steps(engine) if prefill == 0 and decode == batch]
        found[f"decode x{batch}"] = (1000 * statistics.median(s for s, _ in decodes),
                                     sum(c for _, c in decodes) / sum(s for s, _ in decodes))
    engine.add_request("p", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(PREFILL)],
                       sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    seconds, collective, prefill, _ = timed_steps(engine)[0]
    assert prefill == PREFILL
    found[f"prefill {PREFILL}"] = (1000 * seconds, collective / seconds)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.tp_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="demo,smol8")
    parser.add_argument("--systems", default="1,2,2-gloo", help="tensor_parallel_size, -gloo: without shared memory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(REPO_ROOT / "perf" / "results" / "tp_bench.json"))
    args = parser.parse_args(argv)
    build_demo()
    scratch = tempfile.mkdtemp(prefix="tp-bench-")
    folders = {"demo": str(DEMO_DIR), "smol8": smol8_folder(scratch) if "smol8" in args.models else None}
    systems = args.systems.split(",")
    results: dict[str, dict[str, list[dict]]] = {}
    for model in args.models.split(","):
        results[model] = {system: [] for system in systems}
        for round_index in range(args.rounds):
            for size in (systems if round_index % 2 == 0 else systems[::-1]):
                engine = engine_for(folders[model], size, args.dtype)
                try:
                    found = measure(engine, engine.vocab_size, random.Random(round_index))
                finally:
                    engine.close()
                results[model][size].append(found)
                print(f"{model} round {round_index + 1}/{args.rounds} size {size}: "
                      + ", ".join(f"{case} {ms:.1f} ms ({share:.0%} comm)" for case, (ms, share) in found.items()),
                      flush=True)
    cases = [f"decode x{b}" for b in DECODE_BATCHES] + [f"prefill {PREFILL}"]
    lines = ["| model | size (threads per rank) | " + " | ".join(f"{c} ms (comm share)" for c in cases) + " |",
             "| --- | --- |" + " ---: |" * len(cases)]
    for model, by_size in results.items():
        for size, runs in by_size.items():
            cells = []
            for case in cases:
                ms = statistics.median(r[case][0] for r in runs)
                share = statistics.median(r[case][1] for r in runs)
                cells.append(f"{ms:.1f} ({share:.0%})" if size != "1" else f"{ms:.1f}")
            threads = len(os.sched_getaffinity(0)) if size == "1" else 1
            lines.append(f"| {model} | {size} ({threads}) | " + " | ".join(cells) + " |")
        for size in by_size:
            if size != "1" and "1" in by_size:
                ratios = [statistics.median(r[c][0] for r in by_size[size])
                          / statistics.median(r[c][0] for r in by_size["1"]) for c in cases]
                lines.append(f"| {model} | {size} / 1 (step time) | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    table = "\n".join(lines)
    print(table)
    write_json({"tool": "perf.tp_bench", "created": now_iso(), "git": git_state(), "machine": machine_info(),
                "dtype": args.dtype, "settings": {**vars(args), "context": CONTEXT, "prefill": PREFILL,
                                                  "decode_steps": DECODE_STEPS},
                "runs": results, "table": table}, args.out)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
