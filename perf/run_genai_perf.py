"""genai-perf 0.0.8 against the `llm` model (Triton service kind, TensorRT-LLM input format).

    python -m perf.run_genai_perf [--concurrency 1,4] [--input-len 128] [--output-len 64]
        [--num-prompts 100] [--url HOST:PORT | --model-repository DIR] [--out-dir DIR]
        [-- extra genai-perf profile args, e.g. -- -- --request-count 8 for perf_analyzer]

Starts tritonserver on free ports (always stopped) unless --url names a running one, then runs
``genai-perf profile -m llm --service-kind triton --backend tensorrtllm --streaming --tokenizer
models/smollm2-135m-instruct`` once per concurrency with synthetic prompts of --input-len tokens (stddev 0)
and deterministic --output-len outputs (genai-perf sends max_tokens and min_length). Reports
(genai-perf's CSV/JSON exports, its profile export, the console log) go under
perf/results/genai_perf/<UTC time>/concurrency<N>/. genai-perf is found next to this interpreter
(pip install genai-perf==0.0.8, the perf extra) or at .peers/genai-perf/bin when installed apart.

``--endpoint-type chat`` (or ``completions``) profiles the OpenAI-compatible front instead
(``--service-kind openai``, openai_front): give its address with ``--url HOST:PORT`` (``make
serve`` puts it on localhost:9000).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from backend.paths import REPO_ROOT
from perf.perf_analyzer_env import perf_analyzer_environment, perf_analyzer_problem
from perf.served import (
    parse_tool_args,
    run_logged,
    served,
    tool_parser,
)


def find_genai_perf() -> Path | None:
    """genai-perf beside this interpreter, in .peers/genai-perf, or on PATH."""
    for candidate in (Path(sys.executable).parent / "genai-perf", REPO_ROOT / ".peers" / "genai-perf" / "bin" / "genai-perf"):
        if candidate.exists():
            return candidate
    found = shutil.which("genai-perf")
    return Path(found) if found else None


def genai_perf_problem() -> str | None:
    """None when genai-perf and the perf_analyzer it drives can run; otherwise why not."""
    if find_genai_perf() is None:
        return "genai-perf not found: pip install genai-perf==0.0.8 (the perf extra)"
    return perf_analyzer_problem()


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("python -m perf.run_genai_perf", __doc__, "synthetic prompt tokens", "genai_perf")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated; one genai-perf run each (default: %(default)s)")
    parser.add_argument("--measurement-interval-ms", type=int, default=None, help="genai-perf -p (default: its 10000)")
    parser.add_argument("--endpoint-type", default="triton", choices=("triton", "chat", "completions"),
                        help="triton: the `llm` model over gRPC (default); chat or completions: the OpenAI "
                             "front at --url")
    return parser


def service_arguments(args, url: str) -> list[str]:
    """genai-perf's service options: Triton's gRPC endpoint, or an OpenAI endpoint of the front."""
    if args.endpoint_type == "triton":
        return ["--service-kind", "triton", "--backend", "tensorrtllm", "-u", url, "--output-tokens-mean-deterministic"]
    return ["--service-kind", "openai", "--endpoint-type", args.endpoint_type, "-u", url]


def main(argv: list[str] | None = None) -> int:
    parsed = parse_tool_args(build_parser(), argv, genai_perf_problem(), "genai_perf")
    if isinstance(parsed, int):
        return parsed
    args, extra, out_root = parsed
    if args.endpoint_type != "triton" and not args.url:
        print("error: --endpoint-type chat/completions profiles the OpenAI front: give its --url HOST:PORT",
              file=sys.stderr)
        return 2
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    worst = 0
    with served(args) as server:
        for concurrency in concurrencies:
            artifact_dir = (out_root / f"concurrency{concurrency}").resolve()
            artifact_dir.mkdir(parents=True, exist_ok=True)
            command = [
                str(find_genai_perf()), "profile", "-m", args.model, *service_arguments(args, server.grpc_url),
                "--streaming", "--tokenizer", str(Path(args.tokenizer).resolve()), "--concurrency", str(concurrency),
                "--num-prompts", str(args.num_prompts), "--random-seed", str(args.seed),
                "--synthetic-input-tokens-mean", str(args.input_len), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(args.output_len), "--output-tokens-stddev", "0",
                "--artifact-dir", str(artifact_dir),
            ]
            if server.server is not None:  # our own server: let genai-perf read its /metrics too
                command += ["--server-metrics-url", server.server.metrics_url]
            if args.measurement_interval_ms:
                command += ["--measurement-interval", str(args.measurement_interval_ms)]
            command += extra
            # genai-perf writes relative artifacts into its working folder: run it inside ours.
            env = {**perf_analyzer_environment(), "COLUMNS": "160"}  # its table is unreadable at 80
            code = run_logged(command, artifact_dir / "genai_perf.log", args.timeout, env, cwd=artifact_dir)
            print(f"genai-perf (concurrency {concurrency}) exited with {code}; reports in {artifact_dir}", flush=True)
            worst = worst or code
    return worst


if __name__ == "__main__":
    sys.exit(main())
