"""client.bench's statistics (TTFT, ITL, TPOT, E2E, goodput) from a perf_analyzer profile export.

perf_analyzer's ``--profile-export-file`` keeps each request's send time and every response's
arrival time (ns) and outputs; turning them into ``RequestRecord``s lets its runs be read with
exactly the definitions client.bench uses. A response's tokens are its ``output_ids``; responses
without them (an empty final response) carry none.

    python -m perf.profile_export_stats perf/results/perf_analyzer/<time>/profile_export.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from client.bench.stats import RequestRecord, compute_metrics

NS = 1e-9


def _num_tokens(output: dict | None) -> int:
    if output is None:
        return 1  # older exports keep no outputs: one token per response
    ids = output.get("output_ids")
    if ids is None or ids == "":
        return 0
    return len(ids) if isinstance(ids, list) else 1


def records_from_experiment(experiment: dict) -> list[RequestRecord]:
    records = []
    for request in experiment["requests"]:
        start = request["timestamp"] * NS
        outputs = request.get("response_outputs") or [None] * len(request["response_timestamps"])
        token_times, num_tokens = [], 0
        for stamp, output in zip(request["response_timestamps"], outputs, strict=False):
            count = _num_tokens(output)
            if count:
                token_times.append(stamp * NS)
                num_tokens += count
        end = request["response_timestamps"][-1] * NS if request["response_timestamps"] else start
        records.append(RequestRecord(start, end, token_times[0] if token_times else None, tuple(token_times),
                                     num_tokens, error=None if token_times else "no tokens"))
    return records


def summarize_export(path: str | Path) -> list[dict]:
    """One row per experiment (concurrency or rate): its label and client.bench metrics."""
    export = json.loads(Path(path).read_text())
    rows = []
    for experiment in export["experiments"]:
        records = records_from_experiment(experiment)
        bounds = experiment.get("window_boundaries") or []
        duration = (bounds[-1] - bounds[0]) * NS if len(bounds) >= 2 else None
        label = f"{experiment['experiment']['mode']}={experiment['experiment']['value']}"
        rows.append({"label": label, "metrics": compute_metrics(records, duration).to_dict()})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.profile_export_stats", description=__doc__.split("\n\n")[0])
    parser.add_argument("profile_export")
    args = parser.parse_args(argv)
    for row in summarize_export(args.profile_export):
        m = row["metrics"]
        print(f"{row['label']}: {m['num_completed']} requests, {m['output_token_throughput']:.1f} out tok/s, "
              f"TTFT p50/p99 {m['ttft_ms']['p50']:.1f}/{m['ttft_ms']['p99']:.1f} ms, "
              f"ITL p50/p99 {m['itl_ms']['p50']:.1f}/{m['itl_ms']['p99']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
