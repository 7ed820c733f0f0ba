"""Speculative decoding against none, on the `llm` model's config (issue 17; ``--model-folder``
picks another).

One run, the systems side by side in one process (engine level, perf/engine_driver.py: the decode
work speculation changes, without Triton's constant per-response cost), each request stream
closed-loop at a fixed concurrency, systems alternating within each concurrency:

- ``copy``: chat prompts asking SmolLM2-135M-Instruct to repeat, or lightly edit, a passage of
  several hundred tokens (slices of data/demo_corpus.txt: Python documentation and code), greedy,
  ending at the model's own EOS or max_tokens; at concurrency 1, 4 and 16.
- ``mixed``: client.bench's prompts of 64-512 tokens and 64-128 output tokens (ignore_eos), at
  concurrency 32: a load where the compute slack speculation lives on is gone.

Systems: speculation off; prompt lookup (``ngram``) with the controller (``auto``) and without it
(``off``: always propose); a draft model (a 6-layer truncation of the target itself, built by
backend/spec_decode/truncated_draft.py: the only draft with the target's vocabulary that can be
made here) with and without the controller. Per system: ITL p50 (per request, (last token -
first token) / (tokens - 1), then the median over requests), output tokens/s (all output tokens /
wall time), the acceptance rate (accepted / proposed), and the fraction of steps the controller let
speculate. Greedy outputs are compared with speculation off and the number of differing requests
printed (bfloat16: a verification forward of 1 + k rows may round differently from a one-row
decode, which can flip a near-tie; float32 runs are token-equal in the tests).

``--repeat R`` runs every system R times per workload (the order reversed each time) and reports
medians (a shared machine's noise moves single runs). Writes spec_decode.md/.json/.png.

    python -m perf.spec_decode [--requests 8] [--concurrency 1,4,16] [--mixed-requests 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.paths import REPO_ROOT
from backend.protocol.sampling import SamplingParams
from backend.spec_decode.truncated_draft import build as build_draft
from client.bench.arrivals import ArrivalPattern
from client.bench.report import MISSING_MATPLOTLIB, save_figure
from perf import engine_driver
from perf.served import RESULTS_DIR, write_report

TARGET = REPO_ROOT / "models" / "smollm2-135m-instruct"
DRAFT = REPO_ROOT / "models" / "smollm2-135m-draft6"  # the draft the real-model tests build too
DRAFT_LAYERS = 6
DRAFT_DIR = "{draft}"  # filled in with the draft built from the target
SYSTEMS = {
    "off": {},
    "ngram": {"speculative_method": "ngram"},
    "ngram-always": {"speculative_method": "ngram", "speculative_controller": "off"},
    "draft": {"speculative_method": "draft", "speculative_model_dir": DRAFT_DIR},
    "draft-always": {"speculative_method": "draft", "speculative_model_dir": DRAFT_DIR, "speculative_controller": "off"},
}
INSTRUCTIONS = (
    "Repeat the following text exactly, with no comment:",
    "Copy this text word for word:",
    "Rewrite the following text, changing only 'default' to 'standard' wherever it appears:",
    "Repeat this passage exactly as written:",
)


def copy_prompts(engine: LLMEngine, count: int, passage_chars: int, rng: random.Random) -> list[list[int]]:
    corpus = (REPO_ROOT / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    prompts = []
    for index in range(count):
        start = rng.randrange(0, len(corpus) - passage_chars)
        start = corpus.find("\n", start) + 1  # whole lines
        passage = corpus[start : start + passage_chars].rsplit("\n", 1)[0]
        text = engine.render_chat([{"role": "user", "content": f"{INSTRUCTIONS[index % len(INSTRUCTIONS)]}\n\n{passage}"}])
        prompts.append(engine.tokenize(text, add_special_tokens=False))
    return prompts


def draft_for(model_dir: Path) -> Path:
    """The target's first DRAFT_LAYERS layers as a draft model, built once."""
    same = model_dir.resolve() == TARGET.resolve()
    return build_draft(model_dir, DRAFT_LAYERS, DRAFT if same else REPO_ROOT / "build" / f"{model_dir.name}-draft{DRAFT_LAYERS}")


def run_closed_loop(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]], concurrency: int,
                    label: str) -> dict:
    """Every request of ``work`` with ``concurrency`` in flight; per-request token times."""
    before = engine.stats()
    done = engine_driver.run(engine, work, ArrivalPattern("concurrency", concurrency), label=label)
    after = engine.stats()
    times = [record.token_times for record in done.records]
    itl = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    steps = after.spec_decode_num_steps - before.spec_decode_num_steps
    speculated = after.spec_decode_num_speculated_steps - before.spec_decode_num_speculated_steps
    total = done.driver.num_tokens
    return {"itl_p50_ms": statistics.median(itl) * 1000, "tokens_per_second": total / done.duration_s,
            "wall_s": done.duration_s, "output_tokens": total, "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "speculated_fraction": speculated / steps if steps else None,
            "tokens": [record.token_ids for record in done.records]}


def median_run(runs: list[dict]) -> dict:
    """The median ITL p50 and tok/s of a system's runs; counts summed; its first run's tokens."""
    proposed, accepted = sum(r["proposed"] for r in runs), sum(r["accepted"] for r in runs)
    fractions = [r["speculated_fraction"] for r in runs if r["speculated_fraction"] is not None]
    return {"itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in runs),
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            "runs_itl_p50_ms": [r["itl_p50_ms"] for r in runs],
            "runs_tokens_per_second": [r["tokens_per_second"] for r in runs],
            "proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else None,
            "speculated_fraction": statistics.median(fractions) if fractions else None,
            "tokens": runs[0]["tokens"]}


def write_plot(rows: list, path: Path) -> str:
    """ITL p50 and output tok/s against speculation off, per workload and concurrency (bars per system)."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib, the perf extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib, the perf extra)
    except ImportError:
        return MISSING_MATPLOTLIB
    scenarios = list(dict.fromkeys(f"{w} c={c}" for w, c, *_ in rows))
    systems = list(dict.fromkeys(s for _, _, s, *_ in rows))
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(systems)
    for index, system in enumerate(systems):
        picked = [(f"{w} c={c}", r, base) for w, c, s, r, base, _ in rows if s == system]
        xs = [scenarios.index(name) + index * width for name, _, _ in picked]
        left.bar(xs, [base["itl_p50_ms"] / r["itl_p50_ms"] for _, r, base in picked], width, label=system)
        right.bar(xs, [r["tokens_per_second"] / base["tokens_per_second"] for _, r, base in picked], width, label=system)
    for axis, title in ((left, "ITL p50: off / system (higher is better)"),
                        (right, "output tok/s: system / off (higher is better)")):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))], scenarios)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(title)
    left.legend(fontsize=8)
    return save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_driver.add_model_folder_argument(parser)
    parser.add_argument("--requests", type=int, default=8, help="copy requests per concurrency level (at least it)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--passage-chars", type=int, default=1200)
    parser.add_argument("--mixed-requests", type=int, default=64)
    parser.add_argument("--mixed-concurrency", type=int, default=32)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",")]
    target = Path(engine_config_from_model_folder(args.model_folder).model.model_dir)
    draft = str(draft_for(target)) if any("draft" in s for s in systems) else None
    engines = {}
    for system in systems:
        started = time.perf_counter()
        overrides = {key: draft if value == DRAFT_DIR else value for key, value in SYSTEMS[system].items()}
        engines[system] = LLMEngine(engine_config_from_model_folder(args.model_folder, **overrides))
        print(f"{system}: engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    first = next(iter(engines.values()))
    rng = random.Random(17)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    rows, document = [], {"model": str(target), "dtype": str(first.model_runner.dtype), "draft": f"{DRAFT_LAYERS} layers"}
    scenarios = [("copy", c, [(p, SamplingParams(max_tokens=args.max_tokens))
                              for p in copy_prompts(first, max(args.requests, c), args.passage_chars, rng)])
                 for c in levels]
    mixed = engine_driver.token_workload(engine_driver.prompt_builder(first.config), args.mixed_requests,
                                         "uniform:64:512", "uniform:64:128", 17)
    scenarios.append(("mixed", args.mixed_concurrency, mixed))
    for workload, concurrency, work in scenarios:
        for engine in engines.values():  # warm-up: a request each (and the draft's first forwards)
            engine.generate([work[0][0][:64]], [SamplingParams(max_tokens=4)])
        runs: dict[str, list[dict]] = {system: [] for system in systems}
        for repeat in range(args.repeat):
            order = systems if (len(rows) // len(systems) + repeat) % 2 == 0 else list(reversed(systems))
            for system in order:
                r = run_closed_loop(engines[system], work, concurrency, f"{workload}{concurrency}-{system}-{repeat}")
                runs[system].append(r)
                acceptance = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
                print(f"{workload} c={concurrency} {system} [run {repeat + 1}/{args.repeat}]: ITL p50 "
                      f"{r['itl_p50_ms']:.1f} ms, {r['tokens_per_second']:.1f} tok/s, acceptance {acceptance}", flush=True)
        results = {system: median_run(r) for system, r in runs.items()}
        base = results.get("off")
        for system in systems:
            r = results[system]
            differ = sum(a != b for a, b in zip(r["tokens"], base["tokens"], strict=True)) if base else 0
            rows.append((workload, concurrency, system, r, base, differ))
        document[f"{workload}-{concurrency}"] = {s: {k: v for k, v in r.items() if k != "tokens"}
                                                 for s, r in results.items()}
    lines = ["| workload | concurrency | system | ITL p50 ms | ITL off / system | output tok/s | tok/s vs off | "
             "acceptance | steps speculated | requests differing from off |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload, concurrency, system, r, base, differ in rows:
        acceptance = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        fraction = f"{r['speculated_fraction']:.2f}" if r["speculated_fraction"] is not None else "-"
        speedup = f"{base['itl_p50_ms'] / r['itl_p50_ms']:.2f}x" if base else "-"
        ratio = f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "-"
        lines.append(f"| {workload} | {concurrency} | {system} | {r['itl_p50_ms']:.1f} | {speedup} | "
                     f"{r['tokens_per_second']:.1f} | {ratio} | {acceptance} | {fraction} | {differ} |")
    markdown = "\n".join([
        f"Speculative decoding (engine level, {target.name} {first.model_runner.dtype}, "
        f"k = {first.config.speculative.num_speculative_tokens}; draft: the target's first {DRAFT_LAYERS} layers; "
        f"medians of {args.repeat} run(s) per system)",
        "", *lines, ""])
    out = Path(args.out_dir) if args.out_dir else RESULTS_DIR / "spec_decode"
    write_report(out, "spec_decode", document, markdown)
    print(write_plot(rows, out / "spec_decode.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
