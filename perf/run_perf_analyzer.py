"""perf_analyzer concurrency sweep against the `llm` model over gRPC streaming.

    python -m perf.run_perf_analyzer [--concurrency-range 1:8:1] [--input-len 128] [--output-len 64]
        [--url HOST:PORT | --model-repository DIR] [--out-dir DIR] [-- extra perf_analyzer args]

Starts tritonserver on free ports (always stopped) unless --url names a running one. The requests
come from an --input-data JSON written here: --num-prompts prompts of exactly --input-len tokens
(the model's tokenizer; distinct prompts so the prefix cache does not make every request a hit),
with max_tokens=--output-len, ignore_eos=true and stream=true. The report folder
(default perf/results/perf_analyzer/<UTC time>) keeps the input JSON, perf_analyzer's CSV (-f),
its profile export (per-request and per-response timestamps), token_metrics.json (that export
read with client.bench's TTFT/ITL/TPOT definitions) and its console log.

    python -m perf.run_perf_analyzer --tokenizer-batching [--concurrency-range 1:64:x] [--model-repository DIR]

instead sweeps the `tokenizer` model as shipped (dynamic batcher) and ``tokenizer_nobatch`` (the
same model without its dynamic_batching block) in one server started here, one perf_analyzer run
per model and concurrency (``start:end:x`` doubles, ``start:end:step`` adds, or a list), and writes
their CSVs and tokenizer_table.md (throughput, p50/p99 latency, and requests per execution from
Triton's statistics: the batch the dynamic batcher made).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from backend.paths import REPO_ROOT
from client.bench.prompts import PromptBuilder
from perf.compare.repository import repository_with_overrides
from perf.perf_analyzer_env import find_perf_analyzer, perf_analyzer_environment, perf_analyzer_problem
from perf.profile_export_stats import summarize_export
from perf.served import (
    parse_tool_args,
    run_logged,
    served,
    tool_parser,
    tritonserver,
)


def write_input_data(path: Path, tokenizer_dir: str, num_prompts: int, input_len: int, output_len: int,
                     seed: int) -> None:
    """perf_analyzer's --input-data JSON: one entry per prompt, every `llm` input it needs."""
    builder = PromptBuilder(tokenizer_dir)
    rng = np.random.default_rng(seed)
    data = [
        {"text_input": [builder.prompt(input_len, rng)], "max_tokens": [output_len],
         "ignore_eos": [True], "stream": [True]}
        for _ in range(num_prompts)
    ]
    path.write_text(json.dumps({"data": data}, indent=1))


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("python -m perf.run_perf_analyzer", __doc__, "prompt tokens", "perf_analyzer")
    parser.add_argument("--concurrency-range", default="1:8:1", help="start:end:step (default: %(default)s)")
    parser.add_argument("--measurement-request-count", type=int, default=None,
                        help="count windows of this many requests instead of 5 s time windows")
    parser.add_argument("--stability-percentage", type=float, default=None, help="perf_analyzer -s (default: its 10)")
    parser.add_argument("--max-trials", type=int, default=None, help="perf_analyzer -r (default: its 10)")
    parser.add_argument("--tokenizer-batching", action="store_true",
                        help="sweep the tokenizer model with and without its dynamic batcher instead (see below)")
    return parser


def concurrencies(spec: str) -> list[int]:
    """"1:64:x" doubles from 1 to 64, "1:8:2" steps by 2, "1,4,16" lists."""
    if spec.count(":") == 2:
        start, end, step = spec.split(":")
        values, value = [], int(start)
        while value <= int(end):
            values.append(value)
            value = value * 2 if step == "x" else value + int(step)
        return values
    return [int(v) for v in spec.split(",")]


def without_dynamic_batching(config: str) -> str:
    return re.sub(r"dynamic_batching \{.*?\n\}\n", "", config, count=1, flags=re.S)


def tokenizer_batching(args: argparse.Namespace, out_dir: Path) -> int:
    """perf_analyzer on `tokenizer` and `tokenizer_nobatch` (see the module docstring)."""
    corpus = (REPO_ROOT / "data" / "demo_corpus.txt").read_text().split()
    data = [{"text_input": [" ".join(corpus[i * 37 % len(corpus):][:20 + i % 60])]} for i in range(200)]
    input_data = out_dir / "tokenizer_input.json"
    input_data.write_text(json.dumps({"data": data}))
    lines = ["| model | concurrency | infer/s | p50 latency ms | p99 latency ms | requests per execution |",
             "| --- | --- | --- | --- | --- | --- |"]
    source = Path(args.model_repository)
    with tempfile.TemporaryDirectory(prefix="tokenizer-batching-") as work:
        repository_with_overrides(source, "tokenizer", {}, Path(work))
        repository_with_overrides(source, "tokenizer", {}, Path(work), name="tokenizer_nobatch",
                                  edit=without_dynamic_batching)
        with tritonserver(work) as server:
            admin = grpcclient.InferenceServerClient(server.grpc_url)
            for model in ("tokenizer", "tokenizer_nobatch"):
                for concurrency in concurrencies(args.concurrency_range):
                    before = admin.get_inference_statistics(model, as_json=True)["model_stats"][0]
                    report = out_dir / f"{model}_c{concurrency}.csv"
                    # Shared cores make windows differ: accept +-30 % unless told, and report a point that never settles.
                    stability = 30 if args.stability_percentage is None else args.stability_percentage
                    code = run_logged([str(find_perf_analyzer()), "-m", model, "-i", "grpc", "-u", server.grpc_url,
                                       "--concurrency-range", str(concurrency), "--input-data", str(input_data),
                                       "--measurement-interval", "2000", "-s", f"{stability:g}", "-f", str(report)],
                                      out_dir / f"{model}_c{concurrency}.log", args.timeout,
                                      perf_analyzer_environment())
                    after = admin.get_inference_statistics(model, as_json=True)["model_stats"][0]
                    inferences = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
                    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
                    per_execution = f"{inferences / max(executions, 1):.2f}"
                    if code != 0 or not report.exists():
                        lines.append(f"| {model} | {concurrency} | unstable | - | - | {per_execution} |")
                        continue
                    row = next(csv.DictReader(report.open()))
                    lines.append(f"| {model} | {concurrency} | {float(row['Inferences/Second']):.0f} | "
                                 f"{int(row['p50 latency']) / 1000:.2f} | {int(row['p99 latency']) / 1000:.2f} | "
                                 f"{per_execution} |")
            admin.close()
    table = "\n".join(lines)
    (out_dir / "tokenizer_table.md").write_text(table + "\n")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parsed = parse_tool_args(build_parser(), argv, perf_analyzer_problem(), "perf_analyzer")
    if isinstance(parsed, int):
        return parsed
    args, extra, out_dir = parsed
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_batching:
        if args.url:
            print("error: --tokenizer-batching starts its own server (it serves tokenizer_nobatch too)", file=sys.stderr)
            return 2
        return tokenizer_batching(args, out_dir)
    input_data = out_dir / "input_data.json"
    write_input_data(input_data, args.tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed)
    with served(args) as server:
        command = [
            str(find_perf_analyzer()), "-m", args.model, "-i", "grpc", "-u", server.grpc_url, "--streaming",
            "--concurrency-range", args.concurrency_range, "--input-data", str(input_data),
            "-f", str(out_dir / "perf_analyzer.csv"), "--profile-export-file", str(out_dir / "profile_export.json"),
        ]
        if args.measurement_request_count:
            command += ["--measurement-mode", "count_windows",
                        "--measurement-request-count", str(args.measurement_request_count)]
        if args.stability_percentage is not None:
            command += ["-s", f"{args.stability_percentage:g}"]
        if args.max_trials is not None:
            command += ["-r", str(args.max_trials)]
        command += extra
        export = out_dir / "profile_export.json"
        code = run_logged(command, out_dir / "perf_analyzer.log", args.timeout, perf_analyzer_environment())
        if code == 0 and export.exists() and not export.read_text().strip():
            # Seen once in CI: perf_analyzer 2.50 exited 0 after its full report and left an empty
            # profile export. Said and run once more rather than read as a result.
            print("perf_analyzer exited 0 but wrote an empty profile export; running it once more", flush=True)
            code = run_logged(command, out_dir / "perf_analyzer.log", args.timeout, perf_analyzer_environment())
    if code == 0 and export.exists():  # the same run read with client.bench's definitions
        rows = summarize_export(export)
        (out_dir / "token_metrics.json").write_text(json.dumps(rows, indent=2) + "\n")
        for row in rows:
            m = row["metrics"]
            print(f"{row['label']}: {m['output_token_throughput']:.1f} out tok/s, TTFT p50/p99 "
                  f"{m['ttft_ms']['p50']:.1f}/{m['ttft_ms']['p99']:.1f} ms, ITL p50/p99 "
                  f"{m['itl_ms']['p50']:.1f}/{m['itl_ms']['p99']:.1f} ms (client.bench definitions)")
    print(f"perf_analyzer exited with {code}; reports in {out_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
