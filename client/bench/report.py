"""Writes benchmark results: a JSON document, a markdown table and latency-vs-throughput plots.

The JSON holds everything (metadata, every run's metrics and per-request rows); the markdown
table and the plots are views of the same runs. Plots need matplotlib (the ``perf`` extra); without
it they are skipped with a message, never an error.
"""

from __future__ import annotations

import json
from pathlib import Path

MISSING_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install -e '.[perf]')"


def write_json(document: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown_table(runs: list[dict]) -> str:
    """One row per run: throughput, goodput and latency percentiles (ms)."""
    header = (
        "| load | ok | err | dur s | req/s | out tok/s | goodput req/s | TTFT mean | TTFT p50 | TTFT p99 "
        "| ITL p50 | ITL p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 |"
    )
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for run in runs:
        m = run["metrics"]
        goodput = "-" if m["goodput"] is None else f"{m['goodput']:.2f}"
        rows.append(
            f"| {run['arrival']['label']} | {m['num_completed']} | {m['num_errors']} | {m['duration_s']:.1f} "
            f"| {m['request_throughput']:.2f} | {m['output_token_throughput']:.1f} | {goodput} "
            f"| {_ms(m['ttft_ms']['mean'])} | {_ms(m['ttft_ms'].get('p50'))} | {_ms(m['ttft_ms'].get('p99'))} "
            f"| {_ms(m['itl_ms'].get('p50'))} | {_ms(m['itl_ms'].get('p99'))} "
            f"| {_ms(m['tpot_ms'].get('p50'))} | {_ms(m['tpot_ms'].get('p99'))} "
            f"| {_ms(m['e2e_ms'].get('p50'))} | {_ms(m['e2e_ms'].get('p99'))} |"
        )
    return "\n".join(rows) + "\n"


def write_markdown(document: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    workload = document["workload"]
    lines = [
        f"# client.bench: {document['model']} at {document['url']}",
        "",
        f"{document['created']}, commit {document['git']['commit']}{' (dirty)' if document['git']['dirty'] else ''}, "
        f"{document['machine']['cpu_count']} CPUs, {document['machine']['platform']}.",
        f"Input tokens {workload['input_len']['spec']}, output tokens {workload['output_len']['spec']}, "
        f"{workload['num_requests']} requests per run, seed {workload['seed']}"
        + (f", {workload['shared_prefix']['num_prefixes']} shared prefixes of {workload['shared_prefix']['prefix_len']} tokens"
           if workload.get("shared_prefix") else "")
        + ". Latencies in ms.",
        "",
        markdown_table(document["runs"]),
    ]
    path.write_text("\n".join(lines))


def write_plots(document: dict, path: str | Path) -> str:
    """Latency (p50 and p99) against output-token throughput, one point per run; returns a message."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib, the perf extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib, the perf extra)
    except ImportError:
        return MISSING_MATPLOTLIB
    runs = document["runs"]
    throughput = [run["metrics"]["output_token_throughput"] for run in runs]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (key, title) in zip(axes.flat, [("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"),
                                              ("e2e_ms", "End-to-end latency")], strict=True):
        for percentile, style in (("p50", "o-"), ("p99", "s--")):
            values = [run["metrics"][key].get(percentile) for run in runs]
            points = [(x, y) for x, y in zip(throughput, values, strict=True) if y is not None]
            if points:
                axis.plot(*zip(*points, strict=True), style, label=percentile)
        for run, x in zip(runs, throughput, strict=True):
            y = run["metrics"][key].get("p50")
            if y is not None:
                axis.annotate(run["arrival"]["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        axis.set_title(f"{title} vs throughput")
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel("ms")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{document['model']}: {document['workload']['input_len']['spec']} in, "
                    f"{document['workload']['output_len']['spec']} out")
    return save_figure(figure, path)


def save_figure(figure, path) -> str:
    """Lays out, writes (creating the folder) and closes a matplotlib figure; says where."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib, the perf extra)

    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot written to {path}"
