"""The quality evaluation: does a serving change leave the model's answers unchanged?

    python -m perf.quality_eval [--configs all|"NAME; NAME..."] [--concurrency 16]

For each configuration (a copy of model_repository/llm with some parameters changed: dtype, the
attention backend), a tritonserver is started and scored on:

1. perplexity of data/quality/heldout.txt (2,401 tokens of prose written for this repository, not
   the demo tokenizer's corpus), from the server's ``prompt_logprobs``, against transformers in
   float32 on the very token ids the server reports;
2. accuracy on perf/quality/qa_items.py (104 multiple-choice items: arithmetic, capitals, unit
   conversions, Python output), greedy completions after four worked examples, constrained to the
   item's four choices.

A configuration whose perplexity is more than 0.5% off transformers float32, or whose accuracy is
more than 2 points off the float32 configuration's, is named a regression. Results:
perf/results/quality/<UTC time>/quality.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time

from backend.config import engine_config_from_model_folder
from backend.paths import REPO_ROOT
from client.bench.arrivals import ArrivalPattern
from client.bench.runner import run_workload
from client.bench.workload import WorkItem
from client.stream import StreamingClient
from perf.quality.qa_items import ITEMS
from perf.quality.scoring import accuracy, perplexity, reference_logprobs, regressions
from perf.served import DEFAULT_MODEL_REPOSITORY, report_dir, tritonserver, write_report

HELDOUT = REPO_ROOT / "data" / "quality" / "heldout.txt"
CONFIGS = {  # name -> config.pbtxt overrides; the first is the baseline
    "float32, CPU kernels": {"dtype": "float32", "attention_backend": "auto"},
    "float32, torch attention": {"dtype": "float32", "attention_backend": "torch"},
    "bfloat16, CPU kernels": {"dtype": "bfloat16", "attention_backend": "auto"},
    "bfloat16, torch attention": {"dtype": "bfloat16", "attention_backend": "torch"},
}


def score_perplexity(client: StreamingClient, text: str) -> tuple[list[int], list[float]]:
    result = client.generate(text, max_tokens=1, exclude_input_in_output=False, timeout=600,
                             sampling_parameters={"prompt_logprobs": 0})
    if result.error or result.prompt_logprobs is None:
        raise RuntimeError(f"scoring the held-out text failed: {result.error}")
    prompt_ids = result.token_ids[: result.num_input_tokens]
    return prompt_ids, result.prompt_logprobs


def answer_items(url: str, concurrency: int) -> dict[str, str | None]:
    """Every item's greedy answer (None where its request failed), ``concurrency`` in flight."""
    items = [WorkItem(item.prompt(), 0, 16, inputs={"stream": False, "sampling_parameters": {
        "structured_outputs": {"choice": item.constrained_choices()}}}) for item in ITEMS]
    completed, _ = run_workload(url, "llm", items, ArrivalPattern("concurrency", concurrency), timeout_s=300)
    return {item.id: None if done.record.error else done.text.strip()
            for item, done in zip(ITEMS, completed, strict=True)}


def evaluate(name: str, overrides: dict[str, str], concurrency: int) -> dict:
    print(f"[{name}] starting tritonserver ({overrides}) ...", flush=True)
    with tritonserver(DEFAULT_MODEL_REPOSITORY, overrides, ready_timeout=600) as server:
        started = time.monotonic()
        with StreamingClient(server.grpc_url) as client:
            prompt_ids, logprobs = score_perplexity(client, HELDOUT.read_text(encoding="utf-8"))
        print(f"[{name}] perplexity {perplexity(logprobs):.4f} over {len(logprobs)} tokens; answering {len(ITEMS)} items ...",
              flush=True)
        answers = answer_items(server.grpc_url, concurrency)
        row = {"name": name, "overrides": overrides, "perplexity": perplexity(logprobs), "prompt_ids": prompt_ids,
               "num_scored_tokens": len(logprobs), "accuracy": accuracy(answers, ITEMS), "answers": answers,
               "failed_answers": sum(a is None for a in answers.values()), "seconds": time.monotonic() - started}
        print(f"[{name}] accuracy {row['accuracy']['all']:.1f}% ({row['seconds']:.0f} s)", flush=True)
        return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.quality_eval", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="all", help=f"names separated by semicolons (they contain commas), or all ({'; '.join(CONFIGS)})")
    parser.add_argument("--concurrency", type=int, default=16, help="item requests in flight (default: %(default)s)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    names = list(CONFIGS) if args.configs == "all" else [n.strip() for n in args.configs.split(";")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r} (known: {'; '.join(CONFIGS)})")
    out = report_dir(args, "quality")
    rows = [evaluate(name, CONFIGS[name], args.concurrency) for name in names]
    model_dir = engine_config_from_model_folder(str(DEFAULT_MODEL_REPOSITORY / "llm")).model.model_dir
    if any(row["prompt_ids"] != rows[0]["prompt_ids"] for row in rows):
        raise RuntimeError("the configurations tokenized the held-out text differently")
    print("transformers float32 reference ...", flush=True)
    reference = perplexity(reference_logprobs(model_dir, rows[0]["prompt_ids"]))
    baseline = dict(rows[0], reference_perplexity=reference)
    for row in rows:
        row["reference_perplexity"] = reference
        row["regressions"] = regressions(row, baseline)
        del row["prompt_ids"]
    write_report(out, "quality", {"rows": rows, "num_items": len(ITEMS), "heldout_tokens": rows[0]["num_scored_tokens"] + 1},
                 to_markdown(rows, reference))
    return 0


def to_markdown(rows: list[dict], reference: float) -> str:
    kinds = ["arithmetic", "capitals", "units", "code"]
    lines = [f"transformers float32 perplexity: {reference:.4f}", "",
             "| configuration | perplexity | vs transformers fp32 | accuracy | " + " | ".join(kinds)
             + " | regression |", "| --- " * (5 + len(kinds)) + "|"]
    for row in rows:
        acc = row["accuracy"]
        lines.append(f"| {row['name']} | {row['perplexity']:.4f} | {row['perplexity'] / reference - 1:+.3%} | "
                     f"{acc['all']:.1f} | " + " | ".join(f"{acc[k]:.1f}" for k in kinds)
                     + f" | {'; '.join(row['regressions']) or 'none'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
