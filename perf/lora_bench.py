"""LoRA adapters in mixed batches against the base model alone, in-process (issue 34).

    .venv/bin/python -m perf.lora_bench [--adapters 1,4,8] [--rank 16] [--requests 32] [--rounds 3]

On the `llm` model's config (SmolLM2 by default; ``--model-folder`` picks another), with
``--requests`` requests of client.bench's mixed workload (``--input-len``, ``--output-len``) all
at once, the systems alternating within each round (medians over rounds):

- ``base``: the engine without LoRA (``enable_lora`` false);
- ``base (LoRA on)``: the LoRA engine, every request on the base model: what the machinery costs;
- ``N adapters``: the LoRA engine, the requests spread round-robin over N rank-``--rank``
  adapters on all seven projections (made by peft with random non-zero weights, once, in
  ``models/lora-bench``), ``max_loras`` N so they all run together.

With ``--vllm`` (needs ``make peers``), vLLM CPU 0.32 in its tuned setup serves the same folder
with ``--enable-lora`` and the same adapters (``--lora-modules``, ``--max-loras`` N), and the same
rows run against it through its OpenAI streaming completions (token-id prompts, forced lengths),
alternating with ours in each round; its rows are ``vLLM base`` and ``vLLM N adapters``.

Reported: output tokens/s and its ratio to ``base``, TTFT p50, and the time to first token of one
request for an adapter that is not loaded yet (its load included) against one that is. Writes
perf/results/lora_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from backend.config import EngineConfig, engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.models.loader import resolve_dtype
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.report import write_json
from client.bench.stats import summarize_ms
from perf.compare import vllm_server
from perf.engine_driver import add_model_folder_argument, prompt_builder, run, token_workload, warm_up
from perf.served import RESULTS_DIR

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str, count: int, rank: int, out: Path) -> Path:
    """``count`` peft adapters of ``rank`` on every projection (seeded, made once) and their
    multi_lora.json; returns the json's path."""
    import peft  # noqa: PLC0415 (optional: peft, the dev extra)

    out.mkdir(parents=True, exist_ok=True)
    names = [f"r{rank}-{index}" for index in range(count)]
    for index, name in enumerate(names):
        if (out / name / "adapter_model.safetensors").exists():
            continue
        torch.manual_seed(1000 + index)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_MODULES, init_lora_weights=False)
        peft.get_peft_model(base, config).save_pretrained(str(out / name))
    table = out / f"multi_lora_r{rank}.json"
    table.write_text(json.dumps({name: name for name in names}))
    return table


def measure(engine: LLMEngine, requests, adapters: list[str | None]) -> dict:
    """Every request at once, request i on adapters[i % len]."""
    work = [(prompt, SamplingParams(max_tokens=length, ignore_eos=True, lora_name=adapters[i % len(adapters)]))
            for i, (prompt, length) in enumerate(requests)]
    engine.kv_cache_manager.reset_prefix_cache()
    result = run(engine, work)
    records = result.records
    tokens = sum(r.num_output_tokens for r in records)
    ttft = [r.first_token_time - r.arrival for r in records if r.first_token_time is not None]
    return {"output_token_throughput": tokens / result.duration_s, "ttft_ms": summarize_ms(ttft, (50, 99)).to_dict(),
            "duration_s": result.duration_s, "errors": sum(1 for r in records if r.error is not None)}


def measure_vllm(url: str, requests, models: list[str]) -> dict:
    """The same requests through vLLM's OpenAI streaming completions, all at once, request i on
    models[i % len] (the served base name or an adapter's)."""
    import openai  # noqa: PLC0415 (optional: openai, the dev extra)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)

    def one(index: int) -> tuple[float, float, int, str | None]:
        prompt, length = requests[index]
        start = time.monotonic()
        first, tokens = None, 0
        try:
            stream = client.completions.create(model=models[index % len(models)], prompt=prompt, max_tokens=length,
                                               temperature=0.0, stream=True,
                                               extra_body={"ignore_eos": True, "min_tokens": length})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.monotonic()
            tokens = length
        except openai.OpenAIError as exc:
            return start, start, 0, str(exc)
        return start, first or time.monotonic(), tokens, None

    start = time.monotonic()
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(one, range(len(requests))))
    duration = time.monotonic() - start
    ttft = [first - began for began, first, _, error in results if error is None]
    return {"output_token_throughput": sum(r[2] for r in results) / duration,
            "ttft_ms": summarize_ms(ttft, (50, 99)).to_dict(), "duration_s": duration,
            "errors": sum(1 for r in results if r[3] is not None)}


def start_vllm_with_adapters(model_dir: str, table: Path, names: list[str], rank: int, dtype: str,
                             config: EngineConfig):
    """vLLM's tuned server with the adapters of ``table``, under our engine ``config``'s limits (the
    engines measured beside it run under them too)."""
    folders = json.loads(table.read_text())
    extra = ["--enable-lora", "--max-loras", str(len(names)), "--max-lora-rank", str(rank),
             "--max-cpu-loras", str(len(names) + 1),
             "--lora-modules", *[f"{name}={table.parent / folders[name]}" for name in names]]
    return vllm_server.start_vllm(model_dir, setup="tuned", dtype=dtype, max_model_len=config.model.max_model_len,
                                  max_num_seqs=config.scheduler.max_num_seqs,
                                  max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                  extra_args=extra), vllm_server.SERVED_MODEL_NAME


def first_token_seconds(engine: LLMEngine, prompt: list[int], adapter: str) -> float:
    start = time.monotonic()
    engine.add_request(f"ttft-{adapter}-{time.monotonic_ns()}", prompt_token_ids=prompt,
                       sampling_params=SamplingParams(max_tokens=1, ignore_eos=True, lora_name=adapter))
    while engine.has_unfinished_requests():
        engine.step()
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.lora_bench", description=__doc__.split("\n\n")[0])
    add_model_folder_argument(parser)
    parser.add_argument("--adapters", default="1,4,8", help="adapter counts to spread the requests over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", default="uniform:16:512")
    parser.add_argument("--output-len", default="uniform:16:256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "lora_bench.json"))
    parser.add_argument("--vllm", action="store_true", help="vLLM CPU (tuned, --enable-lora) on the same rows")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.adapters.split(",") if n]
    plain_config = engine_config_from_model_folder(args.model_folder)
    table = make_adapters(plain_config.model.model_dir, max(counts), args.rank, REPO_ROOT / "models" / "lora-bench")
    names = list(json.loads(table.read_text()))
    lora_config = engine_config_from_model_folder(args.model_folder, enable_lora="true", lora_adapters=str(table),
                                                  max_loras=str(max(counts)), max_cpu_loras=str(max(counts) + 1),
                                                  max_lora_rank=str(args.rank))
    dtype = str(resolve_dtype(plain_config.model.dtype, None, "cpu")).removeprefix("torch.")
    builder = prompt_builder(plain_config)
    requests = token_workload(builder, args.requests, args.input_len, args.output_len, args.seed,
                              max_model_len=plain_config.model.max_model_len)
    base_engine, lora_engine = LLMEngine(plain_config), LLMEngine(lora_config)
    warm_up(base_engine, requests[0][0])
    warm_up(lora_engine, requests[0][0])
    # Time to first token for an adapter not loaded yet (its load included), then for the same one loaded.
    cold = first_token_seconds(lora_engine, requests[0][0][:64], names[0])
    warm = first_token_seconds(lora_engine, requests[0][0][:64], names[0])
    for name in names:
        first_token_seconds(lora_engine, requests[0][0][:16], name)  # every adapter loaded before measuring
    systems = {"base": (base_engine, [None]), "base (LoRA on)": (lora_engine, [None])}
    systems.update({f"{n} adapter{'s' if n > 1 else ''}": (lora_engine, names[:n]) for n in counts})
    vllm = None
    if args.vllm:
        vllm, served = start_vllm_with_adapters(plain_config.model.model_dir, table, names, args.rank, dtype,
                                                plain_config)
        measure_vllm(vllm.url, requests[:2], [served])  # warm-up
        systems["vLLM base"] = (vllm.url, [served])
        systems.update({f"vLLM {n} adapter{'s' if n > 1 else ''}": (vllm.url, names[:n]) for n in counts})
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for round_index in range(args.rounds):
        order = list(systems) if round_index % 2 == 0 else list(systems)[::-1]
        for name in order:
            engine, adapters = systems[name]
            result = (measure_vllm(engine, requests, adapters) if isinstance(engine, str)
                      else measure(engine, requests, adapters))
            results[name].append(result)
            print(f"[round {round_index + 1}/{args.rounds}] {name}: {result['output_token_throughput']:.1f} tok/s, "
                  f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, errors {result['errors']}", flush=True)
    base = statistics.median(r["output_token_throughput"] for r in results["base"])
    medians = {name: statistics.median(r["output_token_throughput"] for r in runs) for name, runs in results.items()}
    lines = ["| system | output tok/s | vs base | ours / vLLM | TTFT p50 ms | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, runs in results.items():
        tput = medians[name]
        peer = medians.get(f"vLLM {name}")
        lines.append(f"| {name} | {tput:.1f} | {tput / base:.2f}x | {f'{tput / peer:.2f}x' if peer else ''} | "
                     f"{statistics.median(r['ttft_ms']['p50'] for r in runs):.0f} | {sum(r['errors'] for r in runs)} |")
    table_text = "\n".join(lines)
    print(table_text)
    print(f"first token of a 64-token prompt: adapter not loaded {1000 * cold:.0f} ms (load included), "
          f"loaded {1000 * warm:.0f} ms")
    document = {"tool": "perf.lora_bench", "created": now_iso(), "git": git_state(), "machine": machine_info(),
                "model_folder": args.model_folder, "dtype": dtype, "settings": vars(args), "results": results,
                "first_token_seconds": {"not_loaded": cold, "loaded": warm}, "table": table_text}
    write_json(document, args.out)
    print(f"written to {args.out}")
    base_engine.close()
    lora_engine.close()
    if vllm is not None:
        vllm.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
