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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from client.bench.prompts import PromptBuilder
from perf.perf_analyzer_env import find_perf_analyzer, perf_analyzer_environment, perf_analyzer_problem
from perf.profile_export_stats import summarize_export
from perf.served import (
    add_load_arguments,
    add_server_arguments,
    parse_tool_args,
    run_logged,
    served,
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
    parser = argparse.ArgumentParser(prog="python -m perf.run_perf_analyzer", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    add_load_arguments(parser, "prompt tokens", "perf_analyzer")
    parser.add_argument("--concurrency-range", default="1:8:1", help="start:end:step (default: %(default)s)")
    parser.add_argument("--measurement-request-count", type=int, default=None,
                        help="count windows of this many requests instead of 5 s time windows")
    parser.add_argument("--stability-percentage", type=float, default=None, help="perf_analyzer -s (default: its 10)")
    parser.add_argument("--max-trials", type=int, default=None, help="perf_analyzer -r (default: its 10)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parsed = parse_tool_args(build_parser(), argv, perf_analyzer_problem(), "perf_analyzer")
    if isinstance(parsed, int):
        return parsed
    args, extra, out_dir = parsed
    out_dir.mkdir(parents=True, exist_ok=True)
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
