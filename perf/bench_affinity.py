"""Two replicas behind nginx on a shared-prefix workload: consistent hashing vs round-robin.

    .venv/bin/python -m perf.bench_affinity [--num-requests 64 --num-prefixes 16 --prefix-len 256 ...]

One run measures both routings on the same requests in the same order. For each routing it starts
two fresh tritonservers (empty prefix caches) and nginx on deploy/nginx.conf (deploy/local_nginx.py;
round-robin = the same file without its ``hash`` line), sends every request (client.bench's load
generator, closed loop) on a fresh gRPC stream carrying client.routing's header (a hash of the
prompt's first block, i.e. of its shared prefix),
and reports the prefix-cache hit rate (prompt tokens found in the cache / looked up, summed from
both replicas' /metrics) and client-side TTFT p50/p99. Each replica's KV pool holds about half of
the prefixes, as a replica serving many tenants would: affinity keeps each prefix on one replica,
round-robin makes both replicas hold all of them and evict each other's hits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from backend.paths import REPO_ROOT
from backend.server.launcher import free_port, start_server
from client.bench.arrivals import ArrivalPattern
from client.bench.lengths import parse_length
from client.bench.prompts import PromptBuilder
from client.bench.runner import run_workload
from client.bench.stats import summarize_ms
from client.bench.workload import SharedPrefix, WorkItem, build_workload
from client.routing import routing_headers
from client.stream import StreamingClient
from deploy.local_nginx import start_nginx
from deploy.replica_metrics import PREFIX_HITS, PREFIX_QUERIES, SUCCESS, read_counters
from perf.compare.repository import repository_with_overrides
from perf.served import RESULTS_DIR

DEMO_REPOSITORY = REPO_ROOT / "models" / "demo-repository"  # the served configs on the demo model
MODES = {"consistent-hash": True, "round-robin": False}


def measure(mode: str, args, items: list[WorkItem], warmup_prompt: str) -> dict:
    """Fresh replicas + nginx in ``mode``; returns hit rate, TTFT percentiles and per-replica counts."""
    overrides = {"num_kv_blocks": str(args.num_kv_blocks), "max_num_seqs": str(args.concurrency * 2),
                 "max_num_batched_tokens": str(args.max_num_batched_tokens)}
    work = Path(tempfile.mkdtemp(prefix="bench-affinity-"))
    replicas, proxy = [], None
    try:
        replicas = [start_server(repository_with_overrides(DEMO_REPOSITORY, "llm", overrides, work / f"repo{i}"),
                                 wait=False) for i in range(2)]
        for replica in replicas:
            replica.wait_ready(300)
        for replica in replicas:  # first-request overheads stay out of the numbers
            with StreamingClient(replica.grpc_url) as client:
                client.generate(warmup_prompt, max_tokens=2, ignore_eos=True)
        proxy = start_nginx(free_port(), [r.grpc_port for r in replicas], consistent_hash=MODES[mode])
        time.sleep(1.0)  # let the warm-up's counters reach /metrics
        before = [read_counters(r.metrics_url) for r in replicas]
        completed, duration = run_workload(proxy.url, "llm", items, ArrivalPattern("concurrency", args.concurrency),
                                           timeout_s=args.timeout, headers=lambda item: routing_headers(item.prompt))
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
    records = [c.record for c in completed]
    ok = [r for r in records if r.error is None]
    ttft = summarize_ms([r.ttft for r in ok if r.ttft is not None], (50, 99))
    return {
        "mode": mode, "num_requests": len(records), "num_errors": len(records) - len(ok),
        "duration_s": duration, "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
        "requests_per_replica": [int(d[SUCCESS]) for d in delta],
        "ttft_ms": ttft.to_dict(),
        "errors": sorted({r.error for r in records if r.error})[:5],
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

    builder = PromptBuilder(build(DEFAULT_OUT))  # the model demo-repository serves
    items = build_workload(builder, args.num_requests, parse_length(str(args.suffix_len)),
                           parse_length(str(args.output_len)), args.seed,
                           SharedPrefix(args.num_prefixes, args.prefix_len))
    warmup_prompt = builder.prompt(32, np.random.default_rng(args.seed + 1))
    results = []
    for mode in args.modes.split(","):
        print(f"[{mode}] starting two replicas and nginx ...", flush=True)
        results.append(measure(mode, args, items, warmup_prompt))
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
