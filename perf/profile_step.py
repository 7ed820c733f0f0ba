"""Where one engine step's time goes: phases (schedule, prepare, forward, sample, outputs) and operators.

Builds the engine from the `llm` config.pbtxt, puts ``--batch`` requests of ``--prompt-len`` tokens
into it and steps until all of them decode, then times ``--steps`` decode steps two ways:

* phases, by wrapping the step's parts (scheduler, model-runner input preparation, the forward
  pass, the lm head, the sampler) with wall-clock timers: what the rest of ``LLMEngine.step`` costs is the
  remainder (bookkeeping, detokenization, building outputs);
* operators, with ``torch.profiler`` on CPU, grouped into linear layers, attention, norms, rotary
  embedding, activations and the rest.

    .venv/bin/python -m perf.profile_step [--batch 32] [--prompt-len 128] [--steps 20] [--mixed]

``--mixed`` profiles steps that also prefill a new prompt (chunked prefill of ``--prompt-len``
tokens alongside the decodes), the step shape that dominates under steady arrivals.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from perf.engine_driver import EngineDriver, add_model_folder_argument, prompt_builder, token_workload

# aten/mkldnn operator name fragments -> category (first match wins)
CATEGORIES = (
    ("linear", ("linear", "addmm", "aten::mm", "matmul", "mkldnn", "onednn")),
    ("attention", ("cpu_paged_decode", "cpu_paged_prefill", "scaled_dot_product", "bmm", "softmax", "baddbmm", "index_select", "gather", "index_put",
                   "masked_fill", "repeat_interleave")),
    ("norm", ("rsqrt", "pow", "mean", "rms_norm")),
    ("activation", ("silu", "gelu")),  # cpu_fused_silu_mul too
    ("elementwise", ("aten::mul", "aten::add", "aten::cat", "aten::neg", "aten::sub", "aten::div", "copy_",
                     "aten::to", "contiguous", "clone")),
)


# Our own kernels, profiled through torch.profiler.record_function around their ctypes call.
OWN_KERNELS = ("cpu_paged_decode", "cpu_paged_prefill", "cpu_fused_rms_norm", "cpu_fused_silu_mul",
               "cpu_fused_rope_cache")


def category(op_name: str) -> str:
    for name, fragments in CATEGORIES:
        if any(fragment in op_name for fragment in fragments):
            return name
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.profile_step", description=__doc__.split("\n\n")[0])
    add_model_folder_argument(parser)
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="steps timed (default: %(default)s)")
    parser.add_argument("--mixed", action="store_true", help="each timed step also prefills a new prompt")
    parser.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE",
                        help="override a config.pbtxt parameter (repeatable)")
    args = parser.parse_args(argv)

    overrides = dict(item.split("=", 1) for item in args.set)
    engine = LLMEngine(engine_config_from_model_folder(args.model_folder, **overrides))
    driver = EngineDriver(engine)
    builder = prompt_builder(engine.config)
    decodes = token_workload(builder, args.batch, str(args.prompt_len), str(10 * args.steps + 64), 0)
    prefills = token_workload(builder, args.steps if args.mixed else 0, str(args.prompt_len), "1", 1)
    for index, (prompt, max_tokens) in enumerate(decodes):
        driver.add(f"decode{index}", prompt, max_tokens, arrival=time.monotonic())
    while any(r.num_output_tokens == 0 for r in driver.records.values()):  # prefill everything first
        driver.record(driver.step().outputs, time.monotonic())
    for _ in range(3):  # warm-up decode steps
        driver.record(driver.step().outputs, time.monotonic())

    phases: dict[str, float] = defaultdict(float)  # the engine's own phase timings (step(timings=True))
    op_times: dict[str, float] = defaultdict(float)
    step_total = 0.0
    tokens = 0
    activities = [torch.profiler.ProfilerActivity.CPU]
    for step in range(args.steps):
        if args.mixed:
            driver.add(f"prefill{step}", *prefills[step], arrival=time.monotonic())
        with torch.profiler.profile(activities=activities) as profiler:
            start = time.perf_counter()
            step_output = driver.step(timings=True)
            step_total += time.perf_counter() - start
        driver.record(step_output.outputs, time.monotonic())
        tokens += sum(len(o.new_token_ids) for o in step_output.outputs)
        for name, seconds in step_output.stats.timings.items():
            phases[name] += seconds
        for event in profiler.key_averages():
            if event.key.startswith(("aten::", "mkldnn::", "onednn::")) or event.key in OWN_KERNELS or "linear" in event.key:
                op_times[event.key] += event.self_cpu_time_total / 1e6

    per_step_ms = step_total / args.steps * 1000
    print(f"{args.batch} requests decoding ({args.prompt_len}-token prompts){', plus one prefill per step' if args.mixed else ''};"
          f" {args.steps} steps, {tokens} tokens; torch threads {torch.get_num_threads()}")
    print(f"mean step: {per_step_ms:.1f} ms ({tokens / step_total:.0f} tok/s while profiled; the profiler adds overhead)\n")
    print("| phase | ms per step | share |\n| --- | ---: | ---: |")
    accounted = 0.0
    for name, label in (("schedule", "schedule"), ("prepare", "prepare inputs"), ("forward", "forward (model)"),
                        ("logits", "logits (lm head)"), ("sample", "sample"),
                        ("detokenize", "detokenize, stop checks, outputs")):
        value = phases[name] / args.steps * 1000
        accounted += value
        print(f"| {label} | {value:.2f} | {value / per_step_ms:.0%} |")
    rest = per_step_ms - accounted
    print(f"| rest of step | {rest:.2f} | {rest / per_step_ms:.0%} |\n")

    by_category: dict[str, float] = defaultdict(float)
    for name, seconds in op_times.items():
        by_category[category(name)] += seconds
    total_ops = sum(by_category.values()) or 1.0
    print("| operator category (self CPU time) | ms per step | share of operator time |\n| --- | ---: | ---: |")
    for name, seconds in sorted(by_category.items(), key=lambda item: -item[1]):
        print(f"| {name} | {seconds / args.steps * 1000:.2f} | {seconds / total_ops:.0%} |")
    print("\ntop operators:")
    for name, seconds in sorted(op_times.items(), key=lambda item: -item[1])[:12]:
        print(f"  {seconds / args.steps * 1000:7.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
