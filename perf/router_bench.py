"""Routing policies over N replicas on a multi-tenant workload: vllm-router's policies and our nginx hash.

    .venv/bin/python -m perf.router_bench [--model demo|smollm2] [--replicas 3] [--rounds 1]
        [--policies kv_aware,cache_aware,consistent_hash,round_robin,nginx,nginx-round-robin,nginx-http,kv_aware+affinity]
        [--tenants 6 ...]

For each round, each policy in turn (alternating across rounds) gets fresh replicas (empty prefix
caches; backend/server/replicas.py) whose KV pools are sized so that the fleet holds every tenant's
prompts when each replica keeps its share, and one replica cannot (``--num-kv-blocks`` sets them:
more tenants than the fleet can cache), and the same requests (client.bench's tenant workload: T tenants with
their own long system prompts, growing multi-turn sessions, Poisson arrivals). vllm-router's
policies get the requests over OpenAI HTTP with an ``x-session-id`` header naming the session
(what ``consistent_hash`` keys on); ``nginx`` is our compose routing (deploy/nginx.conf: consistent
hash of the same header) over Triton gRPC; ``nginx-round-robin`` the same nginx and transport without
the hash (what affinity buys over nginx's own spreading, with nothing else changed); ``nginx-http`` the same hash over OpenAI HTTP in front of
the replicas' fronts (deploy/local_nginx.py ``start_nginx_http``: the transport vllm-router's
policies use, so ITL compares routing, not transports); ``kv_aware+affinity`` is kv_aware with the router's
session affinity (a session's later turns stay where its first was costed); ``kv_aware+t4`` samples
replicas from softmax(-cost / 4) (``--router-temperature``) instead of taking the cheapest. Reported per policy: TTFT and ITL p50/p99, output
tokens/s, requests per replica, and the fleet's prefix-cache hit rate (hits / lookups summed over
the replicas' /metrics) against the ideal of one replica with an unbounded cache.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.models.loader import resolve_dtype
from backend.paths import REPO_ROOT
from backend.server.replicas import Replicas
from client.bench.arrivals import ArrivalPattern
from client.bench.lengths import parse_length
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.prompts import PromptBuilder
from client.bench.report import MISSING_MATPLOTLIB, save_figure, write_json
from client.bench.runner import API_OPENAI, API_TRITON, run_workload
from client.bench.stats import compute_metrics, percentile
from client.bench.tenants import Tenants, add_tenant_arguments, build_tenant_workload, prefix_reuse
from client.bench.workload import WorkItem
from deploy.local_nginx import start_nginx, start_nginx_http
from deploy.replica_metrics import PREFIX_HITS, PREFIX_QUERIES, SUCCESS, read_counters
from perf.served import RESULTS_DIR

REPOSITORIES = {"demo": REPO_ROOT / "models" / "demo-repository", "smollm2": REPO_ROOT / "model_repository"}
POLICIES = ("kv_aware", "cache_aware", "consistent_hash", "round_robin", "nginx")  # and nginx-round-robin, nginx-http, kv_aware+affinity
NGINX_GRPC_POLICIES = {"nginx": True, "nginx-round-robin": False}  # -> consistent hash of x-session-id
NGINX_POLICIES = (*NGINX_GRPC_POLICIES, "nginx-http")
AFFINITY_SUFFIX = "+affinity"
TEMPERATURE_SUFFIX = "+t"  # kv_aware+t4: the router's softmax temperature 4
SESSION_AFFINITY_TTL_SECONDS = 300
HEADROOM = 1.25  # a replica's pool against its share of the fleet's working set


def session_key(items: list[WorkItem]) -> dict[int, str]:
    """id(item) -> its session's key: the prompt's first turn identifies the session."""
    keys, sessions = {}, {}
    for item in items:
        for start, key in sessions.items():
            if item.prompt.startswith(start):
                keys[id(item)] = key
                break
        else:
            sessions[item.prompt] = f"session-{len(sessions)}"
            keys[id(item)] = sessions[item.prompt]
    return keys


def measure(policy: str, args, items: list[WorkItem], overrides: dict[str, str]) -> dict:
    keys = session_key(items)
    base, _, temperature = policy.partition(TEMPERATURE_SUFFIX)
    router_policy = "round_robin" if policy in NGINX_POLICIES else base.removesuffix(AFFINITY_SUFFIX)
    affinity = SESSION_AFFINITY_TTL_SECONDS if base.endswith(AFFINITY_SUFFIX) else None
    replicas = Replicas(args.replicas, router_policy, model_repository=REPOSITORIES[args.model], overrides=overrides,
                        session_affinity_ttl=affinity, router_temperature=float(temperature) if temperature else None)
    proxy = None
    try:
        if policy in NGINX_POLICIES:
            for index in range(args.replicas):
                replicas.start_replica(index)
            for index in range(args.replicas):
                replicas.wait_replica(index)
            if policy in NGINX_GRPC_POLICIES:
                proxy = start_nginx(replicas.port, [ports.grpc for ports in replicas.ports],
                                    consistent_hash=NGINX_GRPC_POLICIES[policy])
                url, api = proxy.url, API_TRITON
            else:
                proxy = start_nginx_http(replicas.port, [ports.openai for ports in replicas.ports])
                url, api = f"http://{proxy.url}", API_OPENAI
        else:
            replicas.start()
            url, api = replicas.url, API_OPENAI
        metrics_urls = [f"http://127.0.0.1:{ports.metrics}/metrics" for ports in replicas.ports]
        before = [read_counters(u) for u in metrics_urls]
        pattern = ArrivalPattern("rate", args.request_rate)
        completed, duration = run_workload(url, "llm", items, pattern, seed=args.seed, timeout_s=args.timeout,
                                           api=api, headers=lambda item: {"x-session-id": keys[id(item)]})
        time.sleep(1.0)  # the last counters reach /metrics
        after = [read_counters(u) for u in metrics_urls]
    finally:
        if proxy is not None:
            proxy.stop()
        replicas.stop()
    delta = [{name: a[name] - b[name] for name in a} for a, b in zip(after, before, strict=True)]
    hits, queries = sum(d[PREFIX_HITS] for d in delta), sum(d[PREFIX_QUERIES] for d in delta)
    metrics = compute_metrics([c.record for c in completed], duration, None, (50, 99)).to_dict()
    return {"policy": policy, "metrics": metrics, "hit_rate": hits / queries if queries else 0.0,
            "requests_per_replica": [int(d[SUCCESS]) for d in delta], "duration_s": duration,
            "requests": per_request(items, completed, keys)}


def per_request(items: list[WorkItem], completed: list, keys: dict[int, str]) -> list[dict]:
    """Each request's TTFT with what could explain it: its tenant and session, its send time,
    and whether it was ``cold``, i.e. no earlier request of its tenant had a first token when it
    was sent, so no replica could have held its system prompt (every policy pays those)."""
    origin = min(c.record.start_time for c in completed)
    first_token = {}  # tenant -> its earliest first token
    for item, done in zip(items, completed, strict=True):
        if done.record.first_token_time is not None:
            first_token[item.prefix_index] = min(first_token.get(item.prefix_index, math.inf),
                                                 done.record.first_token_time)
    rows = []
    for item, done in zip(items, completed, strict=True):
        record = done.record
        warm = first_token.get(item.prefix_index, math.inf) < record.start_time
        rows.append({"tenant": item.prefix_index, "session": keys[id(item)], "prompt_tokens": item.num_input_tokens,
                     "sent_s": round(record.start_time - origin, 3),
                     "ttft_ms": None if record.ttft is None else round(1000 * record.ttft, 1),
                     "cold": not warm, "error": record.error})
    return rows


def slowest(result: dict, count: int = 3) -> str:
    """The ``count`` slowest first tokens of one run, cold or warm (see per_request)."""
    rows = sorted((r for r in result["requests"] if r["ttft_ms"] is not None), key=lambda r: -r["ttft_ms"])[:count]
    return ", ".join(f"{r['ttft_ms']:.0f} ms ({'cold' if r['cold'] else 'warm'}, tenant {r['tenant']}, "
                     f"sent at {r['sent_s']:.0f} s)" for r in rows)


def warm_ttft_p99(result: dict) -> float:
    """TTFT p99 over the requests a replica could already have held the prefix of (see
    per_request): what routing decides, without the cold first prefills every policy pays."""
    warm = [r["ttft_ms"] for r in result["requests"] if not r["cold"] and r["ttft_ms"] is not None]
    return percentile(warm, 99)


def median_row(policy: str, runs: list[dict], ideal: float) -> str:
    def med(path) -> float:
        return statistics.median(path(run) for run in runs)

    m = lambda name, q: med(lambda r: r["metrics"][name][q])  # noqa: E731
    hit = med(lambda r: r["hit_rate"])
    per_replica = "/".join(str(n) for n in runs[-1]["requests_per_replica"])
    return (f"| {policy} | {m('ttft_ms', 'p50'):.0f} | {m('ttft_ms', 'p99'):.0f} | {med(warm_ttft_p99):.0f} | "
            f"{m('itl_ms', 'p50'):.0f} | {m('itl_ms', 'p99'):.0f} | "
            f"{med(lambda r: r['metrics']['output_token_throughput']):.1f} | "
            f"{100 * hit:.1f}% ({100 * hit / ideal:.0f}% of ideal) | {per_replica} | "
            f"{sum(r['metrics']['num_errors'] for r in runs)} |")


def kv_blocks_per_replica(tenants: Tenants, num_replicas: int, block_size: int) -> int:
    """A replica's share of the fleet's working set (every tenant's system prompt and every
    session's own turns), with headroom; never less than two of the longest requests."""
    blocks = lambda tokens: -(-tokens // block_size)  # noqa: E731
    session_own = tenants.turns * tenants.user_len + (tenants.turns - 1) * tenants.answer_len
    per_tenant = blocks(tenants.system_len) + tenants.sessions_per_tenant * blocks(session_own)
    share = int(HEADROOM * tenants.num_tenants * per_tenant / num_replicas + 0.5)
    return max(share, 2 * blocks(tenants.system_len + session_own + 64))


def write_plot(results: dict[str, list[dict]], ideal: float, title: str, path) -> str:
    """TTFT p50/p99 and the fleet's hit rate per policy (medians over rounds)."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: matplotlib, the perf extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: matplotlib, the perf extra)
    except ImportError:
        return MISSING_MATPLOTLIB
    policies = list(results)
    med = lambda runs, f: statistics.median(f(r) for r in runs)  # noqa: E731
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(policies))
    bars = (("TTFT p50", lambda r: r["metrics"]["ttft_ms"]["p50"]), ("TTFT p99", lambda r: r["metrics"]["ttft_ms"]["p99"]),
            ("TTFT p99, warm requests", warm_ttft_p99))
    for offset, (label, value) in zip((-0.27, 0.0, 0.27), bars, strict=True):
        left.bar([x + offset for x in xs], [med(results[p], value) for p in policies], 0.27, label=label)
    left.set_ylabel("ms (lower is better)")
    left.legend()
    right.bar(xs, [100 * med(results[p], lambda r: r["hit_rate"]) for p in policies], 0.6)
    right.axhline(100 * ideal, color="black", linestyle="--", linewidth=1, label="ideal (one unbounded cache)")
    right.set_ylabel("fleet prefix hit rate, % (higher is better)")
    right.legend(loc="lower right")
    for axis in (left, right):
        axis.set_xticks(list(xs), policies, rotation=20)
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.router_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(REPOSITORIES), default="demo")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rounds", type=int, default=1)
    add_tenant_arguments(parser, default_tenants=6)
    parser.add_argument("--output-len", default="16")
    parser.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--num-kv-blocks", type=int, default=0,
                        help="KV blocks per replica (default: its share of the fleet's working set, with headroom)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "router_bench.json"))
    args = parser.parse_args(argv)
    config = engine_config_from_model_folder(str(REPOSITORIES[args.model] / "llm"))
    dtype = str(resolve_dtype(config.model.dtype, None, "cpu")).removeprefix("torch.")  # what `auto` is here
    builder = PromptBuilder(config.model.tokenizer_dir)
    tenants = Tenants.from_args(args)
    items = build_tenant_workload(builder, tenants, parse_length(args.output_len), args.seed,
                                  config.model.max_model_len)
    ideal = prefix_reuse(builder, items, config.cache.block_size)
    num_kv_blocks = args.num_kv_blocks or kv_blocks_per_replica(tenants, args.replicas, config.cache.block_size)
    overrides = {"num_kv_blocks": str(num_kv_blocks), "max_num_seqs": "16"}
    print(f"{len(items)} requests from {args.tenants} tenants; ideal hit rate {100 * ideal['ideal_hit_rate']:.1f}%; "
          f"{num_kv_blocks} KV blocks per replica", flush=True)
    policies = [p for p in args.policies.split(",") if p]
    results: dict[str, list[dict]] = {p: [] for p in policies}
    for round_index in range(args.rounds):
        order = policies if round_index % 2 == 0 else policies[::-1]
        for policy in order:
            print(f"[round {round_index + 1}/{args.rounds}] {policy}: starting {args.replicas} replicas...", flush=True)
            result = measure(policy, args, items, overrides)
            results[policy].append(result)
            m = result["metrics"]
            if m["errors"]:
                print(f"[{policy}] errors: {m['errors']}", flush=True)
            if not m["num_completed"]:
                raise SystemExit(f"[{policy}] no request completed")
            print(f"[{policy}] TTFT p50 {m['ttft_ms']['p50']:.0f} ms, hit rate {100 * result['hit_rate']:.1f}%, "
                  f"{m['output_token_throughput']:.1f} tok/s, per replica {result['requests_per_replica']}; "
                  f"slowest first tokens: {slowest(result)}", flush=True)
    lines = ["| policy | TTFT p50 ms | TTFT p99 ms | TTFT p99 warm ms | ITL p50 ms | ITL p99 ms | output tok/s | "
             "fleet hit rate | requests per replica | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    lines += [median_row(p, runs, ideal["ideal_hit_rate"]) for p, runs in results.items()]
    table = "\n".join(lines)
    print(table)
    document = {"tool": "perf.router_bench", "created": now_iso(), "git": git_state(), "machine": machine_info(),
                "model": args.model, "dtype": dtype, "settings": vars(args), "overrides": overrides,
                "tenants": tenants.to_dict(), "ideal": ideal, "results": results, "table": table}
    write_json(document, args.out)
    print(f"written to {args.out}")
    title = (f"{args.replicas} replicas of {args.model} ({dtype}, {num_kv_blocks} KV blocks each), "
             f"{args.tenants} tenants, {len(items)} requests at {args.request_rate}/s; commit {(document['git']['commit'] or '?')[:7]}")
    print(write_plot(results, ideal["ideal_hit_rate"], title, Path(args.out).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
