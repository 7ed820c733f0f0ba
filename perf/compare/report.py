"""perf.compare's results: one row per system, a markdown table with ratios, and a bar chart.

Ratios are "ours / theirs" on output-token throughput, against our Triton path and our engine
in-process, so a ratio above 1 means we lead. Latency columns are blank where a system cannot
observe them (offline transformers runs see only when a batch or request ended).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from client.bench.report import MISSING_MATPLOTLIB, save_figure
from client.bench.stats import BenchmarkMetrics, summarize_ms

TRITON_NAME_PREFIX = "Triton llm"
ENGINE_NAME_PREFIX = "our engine"


@dataclass(slots=True)
class SystemResult:
    name: str
    arrival: str
    output_tokens: int
    duration_s: float
    num_requests: int
    num_errors: int = 0
    mismatched_lengths: int = 0  # requests whose token counts differ from the workload's
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    e2e_p50_ms: float | None = None
    load_before: float | None = None  # 1-minute load average when the system started and ended
    load_after: float | None = None
    server_cpu_s: float | None = None  # CPU seconds of the server's processes (or of the in-process system)
    client_cpu_s: float | None = None  # CPU seconds of the load generator (served systems only)
    token_responses: int | None = None  # responses that carried tokens (served systems only)
    cpu_s_by_process: dict[str, float] | None = None  # CPU seconds per process role (perf.compare.cpu_meter)

    @property
    def tokens_per_cpu_second(self) -> float | None:
        """Output tokens per CPU second of everything the run needed: server and client."""
        total = (self.server_cpu_s or 0.0) + (self.client_cpu_s or 0.0)
        return self.output_tokens / total if total > 0 else None

    @property
    def output_token_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @classmethod
    def from_metrics(cls, name: str, metrics: BenchmarkMetrics, arrival: str, mismatched: int = 0,
                     load: tuple[float, float] | None = None) -> SystemResult:
        m = metrics.to_dict()
        return cls(name=name, arrival=arrival, output_tokens=m["total_output_tokens"], duration_s=m["duration_s"],
                   num_requests=m["num_completed"] + m["num_errors"], num_errors=m["num_errors"],
                   mismatched_lengths=mismatched, ttft_p50_ms=m["ttft_ms"].get("p50"),
                   ttft_p99_ms=m["ttft_ms"].get("p99"), itl_p50_ms=m["itl_ms"].get("p50"),
                   itl_p99_ms=m["itl_ms"].get("p99"), tpot_p50_ms=m["tpot_ms"].get("p50"),
                   e2e_p50_ms=m["e2e_ms"].get("p50"), load_before=load[0] if load else None,
                   load_after=load[1] if load else None)

    @classmethod
    def offline(cls, name: str, done: dict, arrival: str, load: tuple[float, float] | None = None) -> SystemResult:
        """From an offline runner's {"output_tokens", "seconds", optional "per_request"} dict; percentiles as
        client.bench computes them for the served rows."""
        per_request = done.get("per_request") or []
        ttft = summarize_ms((r["ttft_s"] for r in per_request if r.get("ttft_s") is not None), (50, 99)).percentiles
        e2e = summarize_ms((r["e2e_s"] for r in per_request if r.get("e2e_s") is not None), (50,)).percentiles
        return cls(name=name, arrival=arrival, output_tokens=int(done["output_tokens"]),
                   duration_s=float(done["seconds"]), num_requests=len(per_request) or done.get("num_requests", 0),
                   ttft_p50_ms=ttft["p50"], ttft_p99_ms=ttft["p99"], e2e_p50_ms=e2e["p50"],
                   load_before=load[0] if load else None, load_after=load[1] if load else None)

    def to_dict(self) -> dict:
        return {**asdict(self), "output_token_throughput": self.output_token_throughput,
                "tokens_per_cpu_second": self.tokens_per_cpu_second}


def _find(results: list[SystemResult], prefix: str, arrival: str | None = None) -> SystemResult | None:
    """The first result named ``prefix``..., at ``arrival`` when there is one there."""
    named = [r for r in results if r.name.startswith(prefix)]
    return next((r for r in named if r.arrival == arrival), named[0] if named else None)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(ours: SystemResult | None, theirs: SystemResult) -> str:
    if ours is None or theirs.output_token_throughput <= 0:
        return "-"
    return f"{ours.output_token_throughput / theirs.output_token_throughput:.2f}x"


def markdown_report(document: dict, results: list[SystemResult]) -> str:
    """The table (one row per system, ratios against ours) and the headline ratios."""
    workload = document["workload"]
    sweep = [arrival["label"] for arrival in workload.get("arrivals", [])]
    arrivals = f"{', '.join(sweep)} (each point its own prompts)" if sweep else workload["arrival"]["label"]
    lines = [
        f"Workload: {workload['num_requests']} requests, input {workload['input_len']} "
        f"({workload['prompt_tokens']} tokens), output {workload['output_len']} ({workload['output_tokens']} tokens, "
        f"forced), {arrivals}, {workload['dtype']}, seed {workload['seed']}. "
        f"Commit {str(document['git'].get('commit'))[:10]}{' (dirty)' if document['git'].get('dirty') else ''}, "
        f"{document['machine'].get('cpu_count', '?')} CPUs. Latencies in ms.",
        f"Runtime: {_runtime_text(document)}.",
        "",
        "| system | arrivals | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | E2E p50 | errors "
        "| length mismatches | CPU s server/client | out tok per CPU s | load avg start/end | Triton llm / this "
        "| engine / this |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in results:
        load = "-" if r.load_before is None else f"{r.load_before:.1f}/{r.load_after:.1f}"
        cpu = "-" if r.server_cpu_s is None else f"{r.server_cpu_s:.1f}/" + (
            "-" if r.client_cpu_s is None else f"{r.client_cpu_s:.1f}")
        per_cpu = "-" if r.tokens_per_cpu_second is None else f"{r.tokens_per_cpu_second:.0f}"
        lines.append(
            f"| {r.name} | {r.arrival} | {r.output_token_throughput:.1f} | {_ms(r.ttft_p50_ms)} | {_ms(r.ttft_p99_ms)} "
            f"| {_ms(r.itl_p50_ms)} | {_ms(r.itl_p99_ms)} | {_ms(r.tpot_p50_ms)} | {_ms(r.e2e_p50_ms)} | {r.num_errors} "
            f"| {r.mismatched_lengths} | {cpu} | {per_cpu} | {load} "
            f"| {_ratio(_find(results, TRITON_NAME_PREFIX, r.arrival), r)} "
            f"| {_ratio(_find(results, ENGINE_NAME_PREFIX, r.arrival), r)} |")
    lines.append("")
    headline = []
    if not sweep:
        headline += _ratio_lines(results)
    for label in sweep:  # each point against ours at that point (the offline systems have one row)
        at = [r for r in results if r.arrival == label or r.name.startswith("transformers")]
        headline += [f"- at {label}: {line.removeprefix('- ')}" for line in _ratio_lines(at)]
    for r in results:
        if r.server_cpu_s is not None and r.output_tokens:
            total = r.server_cpu_s + (r.client_cpu_s or 0.0)
            at = f" ({r.arrival})" if sweep else ""
            headline.append(f"- CPU ms per output token, {r.name}{at}: {1000 * total / r.output_tokens:.2f} "
                            f"(server {1000 * r.server_cpu_s / r.output_tokens:.2f})")
    for r in results:
        if r.cpu_s_by_process and r.output_tokens:
            at = f" ({r.arrival})" if sweep else ""
            headline.append(f"- CPU ms per output token by process, {r.name}{at}: "
                            f"{_by_process_text(per_token_by_process(r))}")
    for r in results:
        if r.token_responses:
            at = f" ({r.arrival})" if sweep else ""
            headline.append(f"- responses, {r.name}{at}: {r.token_responses / max(1, r.num_requests):.1f} per request, "
                            f"{r.output_tokens / r.token_responses:.2f} tokens each")
    ipc = document.get("systems", {}).get("engine_core_ipc", {})
    for system, summary in ipc.items():
        headline.append(f"- engine-core IPC per step ({system}): median {summary['median_us']:.0f} us "
                        f"over {summary['count']} steps")
    return "\n".join(lines + headline) + "\n"


MIN_SHOWN_MS = 0.05  # processes that used less per output token (idle models' stubs) are left out


def per_token_by_process(r: SystemResult) -> dict[str, float]:
    """CPU ms per output token of each process role of ``r`` (empty when not measured)."""
    if not r.cpu_s_by_process or not r.output_tokens:
        return {}
    return {role: 1000 * seconds / r.output_tokens for role, seconds in r.cpu_s_by_process.items()}


def _by_process_text(per_token: dict[str, float]) -> str:
    shown = sorted(((ms, role) for role, ms in per_token.items() if ms >= MIN_SHOWN_MS), reverse=True)
    return ", ".join(f"{role} {ms:.2f}" for ms, role in shown) or "-"


def _ratio_lines(results: list[SystemResult]) -> list[str]:
    """The headline ratios (with the issues' targets) among ``results``."""
    triton, engine = _find(results, TRITON_NAME_PREFIX), _find(results, ENGINE_NAME_PREFIX)
    vllm = [r for r in results if r.name.startswith("vLLM")]
    best_vllm = max(vllm, key=lambda r: r.output_token_throughput, default=None)
    static = _find(results, "transformers static")
    headline = []
    if engine and static:
        headline.append(f"- engine / transformers static: **{_ratio(engine, static)}** (target >= 3x)")
    if triton and static:
        headline.append(f"- Triton llm / transformers static: **{_ratio(triton, static)}**")
    if best_vllm and engine:
        headline.append(f"- engine / best vLLM ({best_vllm.name}): **{_ratio(engine, best_vllm)}** (target >= 1.2x)")
    if best_vllm and triton:
        headline.append(f"- Triton llm / best vLLM ({best_vllm.name}): **{_ratio(triton, best_vllm)}** (target >= 1.0x)")
    if triton and engine:
        headline.append(f"- Triton llm / engine in-process: **{_ratio(triton, engine)}** (target >= 0.95x)")
    in_thread = _find(results, "In-thread engine")
    for served in (triton, in_thread):
        if served is None or engine is None:
            continue
        headline.append(f"- {served.name} / engine in-process: {_ratio(served, engine)} output tok/s, TTFT p50 "
                        f"{_relative(served.ttft_p50_ms, engine.ttft_p50_ms)}, ITL p50 "
                        f"{_relative(served.itl_p50_ms, engine.itl_p50_ms)} (targets: within 10%)")
    return headline


def _relative(value: float | None, reference: float | None) -> str:
    """``value`` against ``reference`` as a signed percentage (+12% is 12% slower for a latency)."""
    if value is None or not reference:
        return "-"
    return f"{100 * (value / reference - 1):+.0f}%"


PLOT_INCHES_PER_BAR = 0.55


def write_plot(results: list[SystemResult], path: str | Path) -> str:
    """Output tok/s per system (bars) with TTFT p50 where known; returns a message."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib, the perf extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib, the perf extra)
    except ImportError:
        return MISSING_MATPLOTLIB
    if not results:
        return "no results to plot"
    # each bar's label takes two lines: give every bar its own height, so 15 runs' labels don't overlap
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, max(5.0, 1.0 + PLOT_INCHES_PER_BAR * len(results))))

    def label(r: SystemResult) -> str:
        return r.name.replace(" (", "\n(")

    def color(r: SystemResult) -> str:  # ours blue, peers gray
        return "tab:blue" if r.name.startswith((TRITON_NAME_PREFIX, ENGINE_NAME_PREFIX)) else "tab:gray"

    left.barh([label(r) for r in results], [r.output_token_throughput for r in results],
              color=[color(r) for r in results])
    left.invert_yaxis()
    left.set_xlabel("output tokens/s (higher is better)")
    left.set_title("Throughput")
    for y, r in enumerate(results):
        left.annotate(f"{r.output_token_throughput:.0f}", (r.output_token_throughput, y), xytext=(3, -3),
                      textcoords="offset points", fontsize=8)
    timed = [r for r in results if r.ttft_p50_ms is not None]
    right.barh([label(r) for r in timed], [r.ttft_p50_ms for r in timed], color=[color(r) for r in timed])
    right.invert_yaxis()
    right.set_xlabel("TTFT p50, ms (lower is better)")
    right.set_title("Time to first token")
    return save_figure(figure, path)


def medians_report(results: list[SystemResult]) -> str:
    """Per system (runs named ``... [run k]``) and arrival, the median of its runs and the ratios of
    medians against our engine's at the same arrival."""
    sweep = len({r.arrival for r in results if not r.name.startswith("transformers")}) > 1
    by_system: dict[tuple[str, str], list[SystemResult]] = {}
    for r in results:
        by_system.setdefault((r.name.rsplit(" [run ", 1)[0], r.arrival), []).append(r)

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def cpu_ms_per_token(r: SystemResult):
        if r.server_cpu_s is None or not r.output_tokens:
            return None
        return 1000 * (r.server_cpu_s + (r.client_cpu_s or 0.0)) / r.output_tokens

    rows = {group: (median([r.output_token_throughput for r in runs]), median([r.ttft_p50_ms for r in runs]),
                    median([r.itl_p50_ms for r in runs]), len(runs), median([r.itl_p99_ms for r in runs]),
                    median([cpu_ms_per_token(r) for r in runs]),
                    median([r.output_tokens / r.token_responses if r.token_responses else None for r in runs]),
                    _median_by_process(runs, median))
            for group, runs in by_system.items()}
    engines: dict[str, tuple] = {}  # arrival -> the first engine row there
    for (name, arrival), row in rows.items():
        if name.startswith(ENGINE_NAME_PREFIX):
            engines.setdefault(arrival, row)
    lines = ["Medians over the runs (alternating systems):", "",
             "| system | runs | output tok/s | TTFT p50 | ITL p50 | ITL p99 | CPU ms per out tok | tokens per response "
             "| tok/s / engine | TTFT p50 vs engine | ITL p50 vs engine | CPU ms per out tok by process |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (name, arrival), (tps, ttft, itl, count, itl99, cpu_ms, per_response, by_process) in rows.items():
        engine = engines.get(arrival, next(iter(engines.values()), None))
        ratio = f"{tps / engine[0]:.2f}x" if engine and engine[0] else "-"
        label = f"{name} ({arrival})" if sweep else name
        cpu_text = "-" if cpu_ms is None else f"{cpu_ms:.2f}"
        per_text = "-" if per_response is None else f"{per_response:.2f}"
        lines.append(f"| {label} | {count} | {tps:.1f} | {_ms(ttft)} | {_ms(itl)} | {_ms(itl99)} | {cpu_text} | {per_text} "
                     f"| {ratio} | {_relative(ttft, engine[1]) if engine else '-'} "
                     f"| {_relative(itl, engine[2]) if engine else '-'} | {_by_process_text(by_process)} |")
    return "\n".join(lines) + "\n"


def _median_by_process(runs: list[SystemResult], median) -> dict[str, float]:
    """Per process role, the median over ``runs`` of its CPU ms per output token."""
    per_run = [per_token_by_process(r) for r in runs]
    roles = {role for values in per_run for role in values}
    return {role: median([values.get(role) for values in per_run]) for role in roles}


def _runtime_text(document: dict) -> str:
    """The thread/allocator settings and the Triton client mode the run was measured under."""
    runtime = dict(document["machine"].get("runtime") or {})
    parts = [f"{key}={value}" for key, value in sorted(runtime.items())]
    client = document["workload"].get("triton_client")
    if client:
        parts.append(f"Triton client: {client}")
    return ", ".join(parts) or "defaults"
