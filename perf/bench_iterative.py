"""`llm` (dynamic batcher + engine thread) against `llm_iterative` (sequence batcher) in one run.

    python -m perf.bench_iterative [--concurrency 1,8,32] [--num-requests 32] [--input-len 64]
                                   [--output-len 32] [--out-dir DIR]

Starts one tritonserver holding `llm`, `llm_iterative` (strategy `oldest`, as shipped) and
`llm_iterative_direct` (the same model with the `direct` strategy, to decide between the two by
measurement), then runs ``client.bench`` on each model with the same workload and seed, one model
after the other, so only one engine works at a time. Prints one table (throughput, TTFT, ITL
p50/p99) and writes each model's client.bench JSON to --out-dir.

    python -m perf.bench_iterative --tokenizer [--tokenizer-concurrency 1:64:x]

instead runs perf_analyzer concurrency sweeps on `tokenizer` as shipped (dynamic batcher) and on
`tokenizer_nobatch` (the same model without the dynamic_batching block), in one server, and writes
perf_analyzer's CSVs and a table (throughput, p50/p99 latency, average batch size from Triton's
statistics) to --out-dir.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from backend.paths import REPO_ROOT
from backend.server.launcher import start_server
from client.bench.cli import main as bench_main

MODEL_REPOSITORY = REPO_ROOT / "models" / "demo-repository"  # the served configs on the demo model
DEMO_MODEL = REPO_ROOT / "models" / "demo-llama"

DIRECT_BATCHING = """sequence_batching {
  iterative_sequence: true
  max_sequence_idle_microseconds: 600000000
  direct {
    max_queue_delay_microseconds: 0
  }
}"""


def write_repository(dest: Path) -> Path:
    """llm, llm_iterative and its `direct` twin, with absolute model paths."""
    for name in ("llm", "llm_iterative"):
        shutil.copytree(MODEL_REPOSITORY / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(MODEL_REPOSITORY / "llm_iterative", dest / "llm_iterative_direct",
                    ignore=shutil.ignore_patterns("__pycache__"))
    direct = dest / "llm_iterative_direct" / "config.pbtxt"
    text = direct.read_text().replace('name: "llm_iterative"', 'name: "llm_iterative_direct"')
    text = re.sub(r"sequence_batching \{.*?\n\}", DIRECT_BATCHING, text, count=1, flags=re.S)
    direct.write_text(text)
    for config in dest.glob("*/config.pbtxt"):
        config.write_text(config.read_text().replace("../../demo-llama", str(DEMO_MODEL)))
    return dest


def write_tokenizer_repository(dest: Path) -> Path:
    """tokenizer (as shipped) and tokenizer_nobatch (no dynamic batcher), absolute tokenizer path."""
    shutil.copytree(MODEL_REPOSITORY / "tokenizer", dest / "tokenizer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(MODEL_REPOSITORY / "tokenizer", dest / "tokenizer_nobatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    plain = dest / "tokenizer_nobatch" / "config.pbtxt"
    text = plain.read_text().replace('name: "tokenizer"', 'name: "tokenizer_nobatch"')
    plain.write_text(re.sub(r"dynamic_batching \{.*?\n\}\n", "", text, count=1, flags=re.S))
    for config in dest.glob("*/config.pbtxt"):
        config.write_text(config.read_text().replace("../../demo-llama", str(DEMO_MODEL)))
    return dest


def tokenizer_sweep(concurrency_range: str, out_dir: Path) -> str:
    """perf_analyzer on both tokenizer models; -> a markdown table."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    from perf.perf_analyzer_env import find_perf_analyzer, perf_analyzer_environment  # noqa: PLC0415

    corpus = (REPO_ROOT / "data" / "demo_corpus.txt").read_text().split()
    data = [{"text_input": [" ".join(corpus[i * 37 % len(corpus):][:20 + i % 60])]} for i in range(200)]
    input_data = out_dir / "tokenizer_input.json"
    input_data.write_text(json.dumps({"data": data}))
    lines = ["| model | concurrency | infer/s | p50 latency ms | p99 latency ms | requests per execution |",
             "| --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="bench-tokenizer-") as tmp:
        server = start_server(write_tokenizer_repository(Path(tmp) / "repo"), ready_timeout=300)
        try:
            admin = grpcclient.InferenceServerClient(server.grpc_url)
            for model in ("tokenizer", "tokenizer_nobatch"):
                for concurrency in _expand(concurrency_range):
                    before = admin.get_inference_statistics(model, as_json=True)["model_stats"][0]
                    report = out_dir / f"{model}_c{concurrency}.csv"
                    # Shared cores make windows differ: accept +-30 %, and report a point that never settles.
                    done = subprocess.run([str(find_perf_analyzer()), "-m", model, "-i", "grpc", "-u", server.grpc_url,
                                           "--concurrency-range", str(concurrency), "--input-data", str(input_data),
                                           "--measurement-interval", "2000", "-s", "30", "-f", str(report)],
                                          env=perf_analyzer_environment(), timeout=300,
                                          stdout=subprocess.DEVNULL, check=False)
                    after = admin.get_inference_statistics(model, as_json=True)["model_stats"][0]
                    inferences = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
                    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
                    per_execution = f"{inferences / max(executions, 1):.2f}"
                    if done.returncode != 0 or not report.exists():
                        lines.append(f"| {model} | {concurrency} | unstable | - | - | {per_execution} |")
                        continue
                    row = next(csv.DictReader(report.open()))
                    lines.append(f"| {model} | {concurrency} | {float(row['Inferences/Second']):.0f} | "
                                 f"{int(row['p50 latency']) / 1000:.2f} | {int(row['p99 latency']) / 1000:.2f} | "
                                 f"{per_execution} |")
        finally:
            server.stop()
    return "\n".join(lines)


def _expand(spec: str) -> list[int]:
    """"1:64:x" doubles from 1 to 64; "1,4,16" lists."""
    if ":" in spec and spec.endswith(":x"):
        start, end = (int(v) for v in spec.split(":")[:2])
        values = []
        while start <= end:
            values.append(start)
            start *= 2
        return values
    return [int(v) for v in spec.split(",")]


def table(results: dict[str, dict]) -> str:
    lines = ["| model | concurrency | out tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, document in results.items():
        for run in document["runs"]:
            m = run["metrics"]
            lines.append(
                f"| {model} | {run['arrival'].get('value', run['arrival'])} | {m['output_token_throughput']:.1f} | "
                f"{m['request_throughput']:.2f} | {m['ttft_ms'].get('p50', 0):.1f} | {m['ttft_ms'].get('p99', 0):.1f} | "
                f"{m['itl_ms'].get('p50', 0):.1f} | {m['itl_ms'].get('p99', 0):.1f} | {m['num_errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_iterative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llm,llm_iterative,llm_iterative_direct")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-requests", default="32")
    parser.add_argument("--input-len", default="64")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "perf" / "results" / "bench_iterative"))
    parser.add_argument("--tokenizer", action="store_true", help="run the tokenizer perf_analyzer sweep instead")
    parser.add_argument("--tokenizer-concurrency", default="1:64:x")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.tokenizer:
        report = tokenizer_sweep(args.tokenizer_concurrency, out_dir)
        (out_dir / "tokenizer_table.md").write_text(report + "\n")
        print(report)
        return 0
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-iterative-") as tmp:
        server = start_server(write_repository(Path(tmp) / "repo"), ready_timeout=600)
        try:
            for model in args.models.split(","):
                path = out_dir / f"{model}.json"
                bench_main(["--url", server.grpc_url, "--model", model, "--concurrency", args.concurrency,
                            "--num-requests", args.num_requests, "--input-len", args.input_len,
                            "--output-len", args.output_len, "--warmup", "2", "--out-json", str(path)])
                results[model] = json.loads(path.read_text())
        finally:
            server.stop()
    report = table(results)
    (out_dir / "table.md").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
