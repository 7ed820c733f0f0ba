"""Two replicas behind nginx on a shared-prefix workload: consistent hashing vs round-robin.

    .venv/bin/python -m perf.bench_affinity [--num-requests 64 --num-prefixes 16 --prefix-len 256 ...]

One run measures both routings on the same requests in the same order. For each routing it starts
two fresh tritonservers (empty prefix caches) and nginx on deploy/nginx.conf (deploy/local_nginx.py;
round-robin = the same file without its ``hash`` line), sends every request on a fresh gRPC stream
carrying client.routing's header (a hash of the prompt's first block, i.e. of its shared prefix),
and reports the prefix-cache hit rate (prompt tokens found in the cache / looked up, summed from
both replicas' /metrics) and client-side TTFT p50/p99. Each replica's KV pool holds about half of
the prefixes, as a replica serving many tenants would: affinity keeps each prefix on one replica,
round-robin makes both replicas hold all of them and evict each other's hits.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from backend.paths import REPO_ROOT
from backend.server.launcher import free_port, start_server
from client.bench.lengths import parse_length
from client.bench.prompts import PromptBuilder
from client.bench.stats import summarize_ms
from client.bench.workload import SharedPrefix, WorkItem, build_workload
from client.routing import routing_headers
from client.stream import StreamingClient
from deploy.local_nginx import start_nginx
from deploy.replica_metrics import PREFIX_HITS, PREFIX_QUERIES, SUCCESS, read_counters

RESULTS_DIR = REPO_ROOT / "perf" / "results"
MODES = {"consistent-hash": True, "round-robin": False}


def write_repository(dest: Path, model_dir: Path, overrides: dict[str, str]) -> Path:
    """The served llm config on the demo model (models/demo-repository) with absolute model paths and
    the given parameters."""
    shutil.copytree(REPO_ROOT / "models" / "demo-repository" / "llm", dest / "llm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = dest / "llm" / "config.pbtxt"
    text = config.read_text()
    for key, value in {"model_dir": str(model_dir), "tokenizer_dir": str(model_dir), **overrides}.items():
        text, count = re.subn(r'(\{ key: "' + re.escape(key) + r'" value: \{ string_value: ")[^"]*(")',
                              lambda m, v=value: m.group(1) + v + m.group(2), text)
        if count != 1:
            raise ValueError(f"config.pbtxt has no parameter {key!r}")
    config.write_text(text)
    return dest


def run_requests(url: str, items: list[WorkItem], concurrency: int, timeout_s: float) -> list[dict]:
    """Closed loop: ``concurrency`` users, each request on a fresh stream with its routing header."""
    records: list[dict | None] = [None] * len(items)
    next_index = iter(range(len(items)))
    lock = threading.Lock()

    def user() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            item = items[index]
            try:
                with StreamingClient(url, headers=routing_headers(item.prompt)) as client:
                    result = client.generate(item.prompt, timeout=timeout_s, max_tokens=item.max_tokens,
                                             ignore_eos=True, stream=True)
                records[index] = {"ttft": result.ttft, "e2e": result.end_time - result.start_time,
                                  "error": result.error}
            except Exception as exc:  # noqa: BLE001 (a failed request is a result, not a crash)
                records[index] = {"ttft": None, "e2e": None, "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=user, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for r in records if r is not None]


def measure(mode: str, args, model_dir: Path, items: list[WorkItem], warmup_prompt: str) -> dict:
    """Fresh replicas + nginx in ``mode``; returns hit rate, TTFT percentiles and per-replica counts."""
    overrides = {"num_kv_blocks": str(args.num_kv_blocks), "max_num_seqs": str(args.concurrency * 2),
                 "max_num_batched_tokens": str(args.max_num_batched_tokens)}
    work = Path(tempfile.mkdtemp(prefix="bench-affinity-"))
    replicas, proxy = [], None
    try:
        replicas = [start_server(write_repository(work / f"repo{i}", model_dir, overrides), wait=False)
                    for i in range(2)]
        for replica in replicas:
            replica.wait_ready(300)
        for replica in replicas:  # first-request overheads stay out of the numbers
            with StreamingClient(replica.grpc_url) as client:
                client.generate(warmup_prompt, max_tokens=2, ignore_eos=True)
        proxy = start_nginx(free_port(), [r.grpc_port for r in replicas], consistent_hash=MODES[mode])
        time.sleep(1.0)  # let the warm-up's counters reach /metrics
        before = [read_counters(r.metrics_url) for r in replicas]
        start = time.monotonic()
        records = run_requests(proxy.url, items, args.concurrency, args.timeout)
        duration = time.monotonic() - start
        time.sleep(1.0)
        after = [read_counters(r.metrics_url) for r in replicas]
    finally:
        if proxy is not None:
            proxy.stop()
        for replica in replicas:
            replica.stop()
        shutil.rmtree(work, ignore_errors=True)
    delta = [{name: a[name] - b[name] for name in a} for a, b in zip(after, before, strict=True)]
    hits, queries = sum(d[PREFIX_HITS] for d in delta), sum(d[PREFIX_QUERIES] for d in delta)
    ok = [r for r in records if r["error"] is None]
    ttft = summarize_ms([r["ttft"] for r in ok if r["ttft"] is not None], (50, 99))
    return {
        "mode": mode, "num_requests": len(records), "num_errors": len(records) - len(ok),
        "duration_s": duration, "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
        "requests_per_replica": [int(d[SUCCESS]) for d in delta],
        "ttft_ms": ttft.to_dict(),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
    }


def markdown(results: list[dict]) -> str:
    lines = ["| routing | requests (per replica) | errors | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        rate = "n/a" if r["prefix_cache_hit_rate"] is None else f"{100 * r['prefix_cache_hit_rate']:.1f} %"
        t = r["ttft_ms"]
        lines.append(f"| {r['mode']} | {r['num_requests']} ({' / '.join(map(str, r['requests_per_replica']))}) | "
                     f"{r['num_errors']} | {rate} | {t['p50']:.1f} | {t['p99']:.1f} | {r['duration_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_affinity", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=16, help="shared system prompts (tenants)")
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens per shared prefix")
    parser.add_argument("--suffix-len", type=int, default=32, help="unique tokens after the prefix")
    parser.add_argument("--output-len", type=int, default=16, help="forced output tokens")
    parser.add_argument("--concurrency", type=int, default=4, help="users in the closed loop (both replicas)")
    parser.add_argument("--num-kv-blocks", type=int, default=160,
                        help="KV blocks per replica (default: ~half the prefixes fit, with 16-token blocks)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out-json", default=str(RESULTS_DIR / "bench_affinity.json"))
    args = parser.parse_args(argv)

    from backend.models.demo_model import DEFAULT_OUT, build  # noqa: PLC0415 (builds the model only when run)

    model_dir = build(DEFAULT_OUT)
    builder = PromptBuilder(model_dir)
    items = build_workload(builder, args.num_requests, parse_length(str(args.suffix_len)),
                           parse_length(str(args.output_len)), args.seed,
                           SharedPrefix(args.num_prefixes, args.prefix_len))
    warmup_prompt = builder.prompt(32, np.random.default_rng(args.seed + 1))
    results = []
    for mode in args.modes.split(","):
        print(f"[{mode}] starting two replicas and nginx ...", flush=True)
        results.append(measure(mode, args, model_dir, items, warmup_prompt))
        print(f"[{mode}] {json.dumps(results[-1])}", flush=True)
    table = markdown(results)
    print(table)
    document = {"args": vars(args), "results": results, "table": table}
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(document, indent=2))
    print(f"wrote {args.out_json}")
    return 0 if all(r["num_errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
