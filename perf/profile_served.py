"""Where the served path's CPU goes: per process, per response, and inside the `llm` stub and tritonserver.

    .venv/bin/python -m perf.profile_served [--set stream_interval=8 ...] [--num-requests 64] \\
        [--input-len uniform:16:512] [--output-len uniform:16:256] [--triton-client stream-per-user] \\
        [--no-py-spy] [--no-perf] [--py-spy-client] [--out-dir DIR]

Starts tritonserver on the model repository (``--set`` changes `llm`'s config.pbtxt parameters in a
copy), runs one workload through client.bench's load generator, and records over that window:

* the CPU seconds of every process (perf.compare.cpu_meter's roles: tritonserver, each stub, each
  engine core, the client), as ms per output token and, for the processes a response passes
  through (the `llm` stub, tritonserver, the client), as ms per response;
* py-spy samples of the `llm` stub (``--nonblocking``: the stub is never paused), per thread, with
  the functions that take the responder thread's time (inclusive and self);
* ``perf record`` samples of tritonserver, by shared object and by symbol;
* with ``--py-spy-client``, py-spy samples of the load generator itself (this process).

Writes profile.md and profile.json (model, dtype, commit, machine and settings included) and the
raw py-spy and perf outputs to the report folder (default perf/results/profile-served/<UTC time>).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from backend.config import engine_config_from_model_folder
from backend.server.process_group import live_processes_in_group
from client.bench.arrivals import ArrivalPattern
from client.bench.lengths import parse_length
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.progress import Progress
from client.bench.prompts import PromptBuilder
from client.bench.runner import run_workload
from client.bench.triton_clients import TRITON_CLIENTS, client_url, run_triton_workload
from client.bench.workload import build_workload
from perf.compare.cpu_meter import CLIENT_ROLE, CpuMeter, process_role
from perf.idle_cpu import wait_until_quiet
from perf.served import DEFAULT_MODEL_REPOSITORY, report_dir, tritonserver

RESPONSE_PATH_ROLES = ("stub llm", "tritonserver", CLIENT_ROLE)
TOP = 15


def parse_settings(values: list[str]) -> dict[str, str]:
    settings = {}
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE, got {value!r}")
        settings[key] = setting
    return settings


def pids_by_role(pgid: int) -> dict[str, int]:
    return {process_role(pid): pid for pid in live_processes_in_group(pgid)}


def start_py_spy(pid: int, path: Path) -> subprocess.Popen | None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy not found (pip install py-spy): the stub is not sampled", flush=True)
        return None
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--threads",
                             "--nonblocking", "--output", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def start_perf(pid: int, path: Path) -> subprocess.Popen | None:
    if shutil.which("perf") is None:
        print("perf not found: tritonserver is not sampled", flush=True)
        return None
    return subprocess.Popen(["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop_sampler(process: subprocess.Popen | None) -> None:
    if process is None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def read_py_spy(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread, frames root first, samples) per line of a raw py-spy file (``frame;frame;...;leaf count``);
    a frame is named ``function (file)``, without its line."""
    stacks = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        names = [f.split(" (", 1)[0] + " (" + f.split(" (", 1)[1].rsplit(":", 1)[0] + ")" if " (" in f else f
                 for f in frames[1:]]
        stacks.append((frames[0], names, int(count)))
    return stacks


def function_shares(stacks: list[tuple[str, list[str], int]]) -> tuple[list, list]:
    """The functions with the largest inclusive and self shares (%) of ``stacks``' samples."""
    total = sum(count for _, _, count in stacks) or 1
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for _, names, count in stacks:
        for name in set(names):
            inclusive[name] += count
        if names:
            leaf[names[-1]] += count
    return ([(name, 100 * n / total) for name, n in inclusive.most_common(TOP)],
            [(name, 100 * n / total) for name, n in leaf.most_common(TOP)])


def py_spy_summary(path: Path) -> dict:
    """Samples per thread, and for the thread with the most samples of a responder, the functions
    with the largest inclusive and self shares."""
    stacks = read_py_spy(path)
    threads: Counter[str] = Counter()
    for thread, _, count in stacks:
        threads[thread] += count
    responders = {t for t, names, _ in stacks if any("Responder._run" in n for n in names)}
    responder = max(responders, key=lambda t: threads[t], default=None)
    summary = {"samples_per_thread": dict(threads.most_common()), "responder_thread": responder}
    if responder is not None:
        summary["responder_inclusive"], summary["responder_self"] = function_shares(
            [s for s in stacks if s[0] == responder])
    return summary


def client_py_spy_summary(path: Path) -> dict:
    """The load generator's samples, every thread together (its users and gRPC's callback threads)."""
    stacks = read_py_spy(path)
    inclusive, leaf = function_shares(stacks)
    return {"samples": sum(count for _, _, count in stacks), "inclusive": inclusive, "self": leaf}


def perf_summary(path: Path) -> dict:
    """tritonserver's samples by shared object and by symbol (self time), from ``perf report``."""
    if not path.exists():
        return {}
    summary = {}
    for key, sort in (("by_shared_object", "dso"), ("by_symbol", "dso,sym")):
        done = subprocess.run(["perf", "report", "-i", str(path), "--stdio", "--no-children", "--sort", sort, "-g",
                               "none", "--percent-limit", "0.5"], capture_output=True, text=True, timeout=300)
        rows = []
        for line in done.stdout.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            percent, _, rest = line.strip().partition("%")
            try:
                rows.append((" ".join(rest.split()), float(percent)))
            except ValueError:
                continue
        summary[key] = rows[:TOP]
    return summary


def report(document: dict) -> str:
    tokens, responses = document["output_tokens"], document["token_responses"]
    per_token = {role: 1000 * s / tokens for role, s in document["cpu_s_by_process"].items()}
    lines = [
        f"Served-path profile: {document['num_requests']} requests, input {document['input_len']}, output "
        f"{document['output_len']}, {document['triton_client']}, {document['dtype']}, settings "
        f"{document['settings'] or 'as shipped'}; commit {str(document['git'].get('commit'))[:10]}"
        f"{' (dirty)' if document['git'].get('dirty') else ''}, {document['machine'].get('cpu_count')} CPUs, "
        f"{document['at']}.",
        "",
        f"{tokens} output tokens in {document['duration_s']:.1f} s ({tokens / document['duration_s']:.1f} tok/s), "
        f"{responses} responses with tokens ({responses / document['num_requests']:.1f} per request, "
        f"{tokens / max(1, responses):.2f} tokens each).",
        "",
        "| process | CPU s | ms per output token | ms per response |",
        "| --- | ---: | ---: | ---: |",
    ]
    for role, seconds in sorted(document["cpu_s_by_process"].items(), key=lambda kv: -kv[1]):
        per_response = f"{1000 * seconds / responses:.3f}" if role in RESPONSE_PATH_ROLES and responses else ""
        lines.append(f"| {role} | {seconds:.2f} | {per_token[role]:.3f} | {per_response} |")
    path_s = sum(document["cpu_s_by_process"].get(role, 0.0) for role in RESPONSE_PATH_ROLES)
    lines += ["", f"Response path (stub llm + tritonserver + client): {1000 * path_s / max(1, responses):.3f} CPU ms "
                  f"per response, {1000 * path_s / tokens:.3f} per output token.", ""]
    spy = document.get("py_spy") or {}
    if spy.get("responder_thread"):
        lines += ["py-spy, `llm` stub, samples per thread: "
                  + ", ".join(f"{t} {n}" for t, n in spy["samples_per_thread"].items()), "",
                  "| responder thread: function (inclusive) | % | function (self) | % |", "| --- | ---: | --- | ---: |"]
        for (name, share), (leaf, leaf_share) in zip(spy["responder_inclusive"], spy["responder_self"], strict=False):
            lines.append(f"| {name} | {share:.1f} | {leaf} | {leaf_share:.1f} |")
        lines.append("")
    client = document.get("client_py_spy") or {}
    if client.get("samples"):
        lines += [f"py-spy, the load generator (client), {client['samples']} samples, every thread together:", "",
                  "| client: function (inclusive) | % | function (self) | % |", "| --- | ---: | --- | ---: |"]
        for (name, share), (leaf, leaf_share) in zip(client["inclusive"], client["self"], strict=False):
            lines.append(f"| {name} | {share:.1f} | {leaf} | {leaf_share:.1f} |")
        lines.append("")
    perf = document.get("perf") or {}
    for key, title in (("by_shared_object", "shared object"), ("by_symbol", "shared object, symbol")):
        if perf.get(key):
            lines += [f"| tritonserver, {title} (self) | % |", "| --- | ---: |"]
            lines += [f"| {name} | {share:.1f} |" for name, share in perf[key]]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.profile_served", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an `llm` config.pbtxt parameter for this run (repeatable)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", default="uniform:16:512")
    parser.add_argument("--output-len", default="uniform:16:256")
    parser.add_argument("--triton-client", default="stream-per-user", choices=TRITON_CLIENTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--no-perf", action="store_true")
    parser.add_argument("--py-spy-client", action="store_true",
                        help="also sample this process, the load generator (py-spy, every thread)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.set)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = report_dir(args, "profile-served")
    out.mkdir(parents=True, exist_ok=True)

    engine_config = engine_config_from_model_folder(str(Path(args.model_repository) / "llm"), dtype=args.dtype)
    builder = PromptBuilder(engine_config.model.tokenizer_dir or engine_config.model.model_dir)
    items = build_workload(builder, args.num_requests, parse_length(args.input_len), parse_length(args.output_len),
                           args.seed, max_model_len=engine_config.model.max_model_len)
    warmup = build_workload(builder, 1, parse_length("16"), parse_length("4"), args.seed + 99)
    pattern = ArrivalPattern("concurrency", args.num_requests)
    with tritonserver(Path(args.model_repository), {"dtype": args.dtype, **settings}, "llm") as server:
        run_workload(server.grpc_url, "llm", warmup, ArrivalPattern("concurrency", 1))
        wait_until_quiet(os.getpgid(server.process.pid))
        roles = pids_by_role(os.getpgid(server.process.pid))
        spy = None if args.no_py_spy else start_py_spy(roles["stub llm"], out / "stub-llm.py-spy.txt")
        perf = None if args.no_perf else start_perf(roles["tritonserver"], out / "tritonserver.perf.data")
        client_spy = start_py_spy(os.getpid(), out / "client.py-spy.txt") if args.py_spy_client else None
        time.sleep(1.0)  # the samplers attach
        cpu = CpuMeter(server.process.pid)
        with Progress("profile", len(items), 10.0) as progress:
            completed, duration = run_triton_workload(client_url(server, args.triton_client), "llm", items, pattern,
                                                      args.triton_client,
                                                      seed=args.seed, progress=progress)
        cpu.stop()
        stop_sampler(spy)
        stop_sampler(perf)
        stop_sampler(client_spy)
    records = [c.record for c in completed]
    document = {
        "at": now_iso(), "git": git_state(), "machine": machine_info(), "model": engine_config.model.model_dir,
        "dtype": args.dtype, "settings": settings, "num_requests": args.num_requests, "input_len": args.input_len,
        "output_len": args.output_len, "triton_client": args.triton_client, "duration_s": duration,
        "output_tokens": sum(r.num_output_tokens for r in records),
        "token_responses": sum(len(r.token_times) for r in records),
        "num_errors": sum(1 for r in records if r.error), "cpu_s_by_process": cpu.seconds_by_role(),
        "py_spy": py_spy_summary(out / "stub-llm.py-spy.txt") if spy else None,
        "perf": perf_summary(out / "tritonserver.perf.data") if perf else None,
        "client_py_spy": client_py_spy_summary(out / "client.py-spy.txt") if client_spy else None,
    }
    (out / "profile.json").write_text(json.dumps(document, indent=2, default=str), encoding="utf-8")
    if not document["output_tokens"]:
        errors = sorted({r.error for r in records if r.error})
        print(f"error: no output tokens ({document['num_errors']} failed requests: {errors[:3]})", file=sys.stderr)
        return 1
    text = report(document)
    (out / "profile.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\nreport: {out / 'profile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
