"""transformers' own continuous batching (paged KV cache) on the CPU, as one system of the side-by-side benchmark.

What: the requests go through transformers 5.x's ``ContinuousBatchingManager`` (``model.init_continuous_batching``),
the same machinery ``model.generate_batch`` wraps, with its paged KV cache and its FIFO scheduler mixing prefill and
decode tokens in one forward pass. We drive the manager directly rather than calling ``generate_batch`` because
``generate_batch`` takes a single ``max_new_tokens`` for all prompts, while every request here has its own forced
length; ``add_request`` takes one per request. Requests are submitted while the generation loop is paused, so they
all reach the scheduler in the same step, as "all offered at once at t=0". Each request is streamed
(``streaming=True``) with per-token timestamps (``record_timestamps=True``): the stream gives the progress line, the
timestamps (taken by the generation thread when the token is appended) give TTFT, and the request's ``lifespan`` end
gives its end-to-end time.

Why: it is the "what you get from transformers itself" point of comparison for our engine: same model, same fp32
weights, same CPU, continuous batching instead of static batches.

Forced lengths and greedy decoding: every request gets ``eos_token_id=-1`` (an empty EOS set in ``RequestState``,
so it never stops early; EOS may be generated and is kept as an ordinary token) and ``max_new_tokens`` = its forced
length; the GenerationConfig has ``do_sample=False`` (the batch processor then takes the argmax). No logits processor
(``min_new_tokens`` would add one and change the greedy choice). The number of generated tokens is counted from the
results and checked against the request: a mismatch raises.

Attention implementation, tried on CPU with transformers 5.24 / torch 2.13:
* ``sdpa`` works (used). In CB mode the paged cache's ``update`` gathers each request's K/V from the paged cache by
  index and SDPA runs over the whole packed batch with a block-diagonal causal mask of shape
  [batch tokens, KV tokens read in the step].
* ``eager`` and ``paged|eager`` work too (``eager`` is switched to ``paged|eager`` by the manager), slower.
* ``paged|sdpa`` loads as plain ``sdpa`` (the ``paged|`` prefix is deprecated and stripped), so it is the same thing.
* ``sdpa_paged`` and ``paged_attention`` are rejected by ``from_pretrained`` (not registered names in 5.24).
* ``flash_attention_2`` fails at load: the flash-attn package is not installed (and is CUDA only).
* ``flex_attention`` loads but the manager refuses it ("not supported for continuous batching").

Continuous-batching settings (explicit, so nothing is sized from "free device memory", which on CPU means 60% of
the machine's RAM: with the default 8192 max batch tokens the SDPA mask alone, [max_batch_tokens, cache tokens +
max_batch_tokens] fp32, would then be tens of GiB on a 24 GiB machine):
* ``page_size`` (block size) 32 tokens: allocation granularity; a small page wastes at most 31 slots per request.
* ``num_blocks``: enough pages for every request's prompt + output at once, plus the FIFO scheduler's 15% safety
  margin (below which it stops admitting prefills), clamped to [64, 2048]. So a workload that fits is never
  preempted, and the cache never exceeds 2048 x 32 = 65536 tokens: with this model's 8 layers x 2 KV heads x 64 dims
  fp32 that is 8 KiB a token, 512 MiB at most (96 MiB for 32 requests of <= 384 tokens).
* ``max_batch_tokens`` 1024 and ``max_requests_per_batch`` 64: the same token budget and sequence cap as our
  engine's defaults (max_num_batched_tokens 1024, max_num_seqs 64). The mask is then at most
  1024 x (65536 + 1024) x 4 B = 272 MiB.
* prefix/block sharing off (the random-prompt workload shares nothing beyond BOS, so hashing blocks is pure
  overhead); no CUDA graphs, no async double buffering, no compile, no decode fast path (flash only).

Cost note: with sdpa the packed batch is one "sequence", so each step gathers every scheduled request's K/V,
repeats it to all query heads (GQA, a copy) and runs SDPA of all query tokens against all of it, masked
block-diagonally: attention work grows with (batch tokens x total KV read), not per request (perf/RESULTS.md has
what a step cost against a padded decode).

Environment notes: without ``psutil`` transformers logs "Cannot get memory breakdown on CPU" and falls back to the
NUMA node's memory; harmless here since num_blocks and max_batch_tokens are given. The torch thread count is left as
the caller set it (reported in ``config``); the generation loop runs in the manager's background thread, which uses
the same intra-op thread pool.

    .venv/bin/python -m perf.compare.transformers_continuous [model_dir]   # tiny demo + greedy parity check
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from backend.models.shape import ceil_div
from client.bench.prompts import PromptBuilder
from perf.engine_driver import token_workload

PAGE_SIZE = 32  # tokens per KV page (the "block size")
MIN_BLOCKS, MAX_BLOCKS = 64, 2048  # clamp for num_blocks: 2048 pages of 32 tokens = 512 MiB of fp32 KV for this model
FIFO_SAFETY_MARGIN = 0.15  # FIFOScheduler's default: no new prefill once fewer than 15% of the blocks are free
MAX_BATCH_TOKENS = 1024  # tokens (prefill + decode) per forward pass, as our engine's max_num_batched_tokens
MAX_REQUESTS_PER_BATCH = 64  # sequences per forward pass, as our engine's max_num_seqs
ATTN_IMPLEMENTATION = "sdpa"
NO_EOS = -1  # RequestState drops negative EOS ids: the request only stops at max_new_tokens


def _num_blocks_for(requests: list[tuple[list[int], int]]) -> int:
    """Pages needed to hold every request at once, over the scheduler's safety margin, clamped."""
    needed = sum(ceil_div(len(prompt) + num_out, PAGE_SIZE) for prompt, num_out in requests)
    return max(MIN_BLOCKS, min(MAX_BLOCKS, math.ceil(needed / (1.0 - FIFO_SAFETY_MARGIN)) + 1))


def _load_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    return model.to("cpu").eval()


def _run(
    model,
    requests: list[tuple[list[int], int]],  # (prompt ids with BOS, forced output length) each, input order
    progress_interval_s: float,
    label: str = "transformers-cb",
) -> tuple[dict, list[list[int]]]:
    """Runs ``requests`` through a fresh continuous-batching manager on ``model``; returns (result dict, tokens)."""
    if not requests:
        raise ValueError("no requests")
    for index, (prompt, num_out) in enumerate(requests):
        if not prompt or num_out < 1:
            raise ValueError(f"request {index}: needs a non-empty prompt and >= 1 output token, got "
                             f"{len(prompt)} prompt tokens, {num_out} outputs")
    generation_config, cb_config = _configs(model, requests)
    with torch.inference_mode():  # start() captures the caller's inference mode for the generation thread
        manager = model.init_continuous_batching(generation_config=generation_config,
                                                 continuous_batching_config=cb_config)
        manager.start()
        try:
            _warm_up(manager, requests)
            config = _describe(model, manager, transformers.__version__)
            stream = _Stream(requests, label)
            stream.run(manager, progress_interval_s)
        finally:
            manager.stop(block=True, timeout=60)
            manager.destroy()
    seconds = stream.end - stream.t0
    per_request = []
    for i, (_, num_out) in enumerate(requests):
        got = len(stream.tokens[i])
        if got != num_out:
            raise RuntimeError(f"request {i}: asked for {num_out} output tokens, transformers produced {got}")
        per_request.append({"ttft_s": stream.ttft[i], "e2e_s": stream.e2e[i], "num_output_tokens": got})
    output_tokens = sum(r["num_output_tokens"] for r in per_request)
    print(f"  {label}: {output_tokens} tokens in {seconds:.2f} s, {output_tokens / seconds:.1f} tok/s", flush=True)
    return ({"output_tokens": output_tokens, "seconds": seconds, "per_request": per_request, "config": config},
            stream.tokens)


def _configs(model, requests: list[tuple[list[int], int]]):
    """(GenerationConfig, ContinuousBatchingConfig): greedy, forced lengths, our engine's batch limits."""
    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(n for _, n in requests), eos_token_id=NO_EOS,
        pad_token_id=model.config.pad_token_id,
    )
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=_num_blocks_for(requests),
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=MAX_REQUESTS_PER_BATCH,
        max_blocks_per_request=0,  # decode fast path: flash_attn_with_kvcache only
        allow_block_sharing=False,
        use_cuda_graph=False,
        use_async_batching=False,
        auto_switch_to_flash=False,
        scheduler_type="fifo",
        safety_margin=FIFO_SAFETY_MARGIN,
    )
    return generation_config, cb_config


def _warm_up(manager, requests: list[tuple[list[int], int]]) -> None:
    """Untimed: a 2-request batch with a prefill and a few decode steps, on the same manager."""
    warm = [list(prompt[:16]) for prompt, _ in requests[:2]]
    for i, prompt in enumerate(warm):
        manager.add_request(prompt, request_id=f"warmup-{i}", max_new_tokens=4, eos_token_id=NO_EOS)
    for _ in warm:
        out = _next_result(manager, timeout_s=300.0)
        if out.error is not None:
            raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error}")


class _Stream:
    """The timed run: every request added at once, then each streamed result recorded."""

    def __init__(self, requests: list[tuple[list[int], int]], label: str):
        self.requests, self.label = requests, label
        n = len(requests)
        self.ids = [f"bench-{i}" for i in range(n)]
        self.index_of = {request_id: i for i, request_id in enumerate(self.ids)}
        self.counts = [0] * n  # tokens generated so far, per request (from the stream)
        self.ttft: list[float | None] = [None] * n  # s from t0 to the request's first token
        self.e2e: list[float | None] = [None] * n  # s from t0 to the request's last token
        self.tokens: list[list[int] | None] = [None] * n  # final generated ids, per request
        self.finished = 0
        self.t0 = self.end = 0.0

    def run(self, manager, progress_interval_s: float) -> None:
        # All requests reach the scheduler in one step: the loop is paused while they are added.
        with manager.pause():
            self.t0 = time.perf_counter()
            for request_id, (prompt, num_out) in zip(self.ids, self.requests, strict=True):
                manager.add_request(list(prompt), request_id=request_id, max_new_tokens=num_out,
                                    eos_token_id=NO_EOS, streaming=True, record_timestamps=True)
        n, last_report, self.end = len(self.requests), self.t0, self.t0
        while self.finished < n:
            out = manager.get_result(timeout=min(0.5, max(0.05, progress_interval_s)))
            now = time.perf_counter()
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"generation thread stopped with {n - self.finished} requests unfinished: "
                                       f"{manager.background_thread_status.fatal_error}")
            elif out.request_id in self.index_of:
                self._record(out, now)
            if now - last_report >= progress_interval_s:
                last_report = now
                done_tokens = sum(self.counts)
                print(f"  {self.label}: {done_tokens} tokens, {done_tokens / (now - self.t0):.0f} tok/s, "
                      f"{self.finished}/{n} requests done", flush=True)

    def _record(self, out, now: float) -> None:
        i = self.index_of[out.request_id]
        if out.error is not None:
            raise RuntimeError(f"request {i} failed: {out.error}")
        self.counts[i] = len(out.generated_tokens)
        if self.ttft[i] is None and out.generated_tokens:
            first = out.timestamps[0] if out.timestamps else now
            self.ttft[i] = first - self.t0
        if out.is_finished():
            self.tokens[i] = list(out.generated_tokens)
            self.e2e[i] = (out.lifespan[1] if out.lifespan[1] > 0 else now) - self.t0
            self.finished += 1
            self.end = now


def _next_result(manager, timeout_s: float):
    """The next finished (or failed) result, raising if the generation thread dies or nothing comes in time."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        out = manager.get_result(timeout=0.5)
        if out is not None and out.is_finished():
            return out
        if out is None and not manager.is_running():
            raise RuntimeError(f"generation thread stopped: {manager.background_thread_status.fatal_error}")
    raise TimeoutError(f"no result within {timeout_s} s")


def _describe(model, manager, transformers_version: str) -> dict:
    """The settings actually in force (resolved by the manager, after its cache exists): JSON-friendly."""
    cb = manager.continuous_batching_config
    cache = manager.batch_processor.cache if manager.batch_processor is not None else None
    return {
        "api": "ContinuousBatchingManager via model.init_continuous_batching(); add_request(streaming=True)",
        "attn_implementation": model.config._attn_implementation,
        "page_size": cb.page_size,
        "num_blocks": cb.num_blocks,
        "kv_cache_tokens": cache.max_tokens_read if cache is not None else None,
        "kv_cache_mib": round(cache.cache_tensor.numel() / 2**20, 1) if cache is not None else None,
        "max_batch_tokens": cb.max_batch_tokens,
        "max_requests_per_batch": cb.max_requests_per_batch,
        "scheduler": cb.scheduler_type,
        "safety_margin": cb.safety_margin,
        "allow_block_sharing": cb.allow_block_sharing,
        "use_cuda_graph": list(cb.use_cuda_graph) if isinstance(cb.use_cuda_graph, tuple) else cb.use_cuda_graph,
        "use_async_batching": cb.use_async_batching,
        "compile": cb.varlen_compile_config is not None or cb.decode_compile_config is not None,
        "logits_processing": bool(manager.logit_processor.do_processing),
        "do_sample": False,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
    }


def run_transformers_continuous(
    model_dir: str,  # HF model folder (config.json, model.safetensors)
    requests: list[tuple[list[int], int]],  # (prompt token ids including BOS, forced number of output tokens) each
    *,
    progress_interval_s: float = 5.0,  # at most one progress line this often
) -> dict:
    """requests: (prompt token ids including BOS, forced number of output tokens) each, all offered at once at t=0.

    Returns {"output_tokens": int (counted from the results), "seconds": float (t0 = submission, to the last result
    received; model load and warm-up excluded), "per_request": [{"ttft_s", "e2e_s", "num_output_tokens"}] in input
    order (times from t0, taken by the generation thread), "config": the continuous-batching settings in force}.
    """
    model = _load_model(model_dir)
    result, _ = _run(model, requests, progress_interval_s)
    return result


def check_greedy_parity(model_dir: str, requests: list[tuple[list[int], int]]) -> list[bool]:
    """Per request: do the continuous-batching tokens equal ``model.generate(do_sample=False)`` run one at a time?"""
    model = _load_model(model_dir)
    _, cb_tokens = _run(model, requests, progress_interval_s=60.0, label="parity-cb")
    matches = []
    for i, (prompt, num_out) in enumerate(requests):
        config = GenerationConfig(do_sample=False, max_new_tokens=num_out, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=model.config.pad_token_id)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), generation_config=config)
        reference = out[0, len(prompt):].tolist()
        same = reference == cb_tokens[i]
        matches.append(same)
        print(f"  parity request {i}: {'match' if same else 'DIFFER'} "
              f"(generate {len(reference)} tokens, CB {len(cb_tokens[i])})", flush=True)
        if not same:
            first = next((k for k, (a, b) in enumerate(zip(reference, cb_tokens[i], strict=False)) if a != b), None)
            print(f"    first difference at output position {first}: generate {reference[:first + 3]} "
                  f"vs CB {cb_tokens[i][:(first or 0) + 3]}", flush=True)
    return matches


def _demo_requests(folder: str, num: int, input_len: str, output_len: str, seed: int):
    return token_workload(PromptBuilder(folder), num, input_len, output_len, seed)


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[2] / "models" / "demo-llama")
    demo = run_transformers_continuous(folder, _demo_requests(folder, 4, "uniform:20:60", "uniform:8:16", seed=0),
                                       progress_interval_s=0.5)
    print({k: v for k, v in demo.items() if k != "per_request"})
    for row in demo["per_request"]:
        print(f"  ttft {row['ttft_s'] * 1000:.0f} ms, e2e {row['e2e_s'] * 1000:.0f} ms, "
              f"{row['num_output_tokens']} tokens")
    print("greedy parity with generate():", check_greedy_parity(folder, _demo_requests(folder, 2, "uniform:20:60", "uniform:8:16", seed=1)))
