"""N replicas of the served model behind vllm-router, from one command.

Each replica is what `make serve` runs (backend/server/launcher.py: tritonserver with the `llm` and
`tokenizer` models, and the OpenAI front beside it) on its own ports, with its own copy of the
model repository whose `llm` publishes KV-cache events on its own loopback port
(``kv_events_endpoint`` and ``kv_events_replay_endpoint``, backend/kv_cache/event_publisher.py).
vllm-router (the `router` extra of pyproject.toml) speaks OpenAI HTTP to the fronts; with the
``kv_aware`` policy (the default) it subscribes to every replica's events and sends a request
where the longest prefix of its tokens is already cached, asking a front for the token ids first
(the front's render endpoints). The router health-checks the fronts' ``/health`` every few
seconds, so a replica that dies stops getting requests and one that comes back gets them again;
the launcher restarts its own tritonserver when it crashes.

Disaggregated (``--prefill P --decode D``): P replicas with ``kv_role: prefill`` (each serving its
finished prompts' KV blocks on its own loopback transfer port) and D with ``kv_role: decode``
(pulling only from those ports, ``kv_transfer_peers``), behind vllm-router's
``--vllm-pd-disaggregation`` mode: it sends each request to a prefill replica with
``kv_transfer_params: {"do_remote_decode": true}`` and ``max_tokens`` 1, then to a decode replica
with the transfer parameters that answer carried (backend/kv_transfer).

Command line: ``python -m backend.server.replicas [--replicas 2 | --prefill 1 --decode 1]
[--policy kv_aware] [--port 8080] [--model-repository DIR]``; Ctrl-C stops the router and every replica.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from backend.config import parameters_from_pbtxt
from backend.proc_stat import all_pids, read_proc_stat
from backend.server.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    answers_200,
    bind_host,
    free_port,
    stop_on_signals,
)
from backend.server.process_group import stop_process_group
from backend.server.repository_copy import copy_repository

POLICIES = ("kv_aware", "cache_aware", "consistent_hash", "round_robin", "power_of_two", "random",
            "sticky_least_loaded")
PD_POLICIES = tuple(p for p in POLICIES if p != "kv_aware")  # kv_aware's PD mode reads events differently
ROLES = ("both", "prefill", "decode")
REPLICA_MODELS = ("llm", "tokenizer")
HEALTH_CHECK_INTERVAL_SECONDS = 2
# kv_aware's softmax temperature when none is given. Its costs are in prompt tokens, so between
# equally loaded replicas a prefix of P cached tokens leaves its holder with a chance below
# exp(-P / T) per other replica (64 tokens at 8: 3e-4), while equal costs (a prompt cached
# nowhere, an idle fleet) spread over the replicas instead of all going to the first (the
# router's own default, 0).
DEFAULT_ROUTER_TEMPERATURE = 8.0
CIRCUIT_OPEN_SECONDS = 5  # vllm-router's default is 60


class ReplicaError(RuntimeError):
    """A replica or the router did not come up."""


@dataclass(frozen=True, slots=True)
class ReplicaPorts:
    http: int
    grpc: int
    metrics: int
    openai: int
    events: int
    replay: int
    transfer: int  # a prefill replica's KV transfer endpoint

    @classmethod
    def free(cls) -> ReplicaPorts:
        return cls(*(free_port() for _ in range(7)))

    @property
    def url(self) -> str:
        """The front, as the router addresses it."""
        return f"http://127.0.0.1:{self.openai}"


def tcp_endpoint(port: int) -> str:
    """A ZMQ endpoint on loopback: where a replica's `llm` publishes its events or serves its blocks."""
    return f"tcp://127.0.0.1:{port}"


# A prefill replica has no decoding streams to keep smooth: larger steps prefill faster (fewer of
# them; perf/RESULTS.md "Disaggregated prefill and decode"). The shipped config.pbtxt has the same
# budget; this keeps it for prefill replicas of a repository that lowered it for its decoders' ITL.
# Overrides given for every replica win.
PREFILL_DEFAULTS = {"max_num_batched_tokens": "2048"}


def role_parameters(role: str, ports: ReplicaPorts, prefill_ports: list[ReplicaPorts]) -> dict[str, str]:
    """`llm`'s disaggregation parameters for a replica of ``role``: a prefill replica serves its
    blocks on its transfer port; a decode replica may pull from every prefill replica's, and only those."""
    if role == "prefill":
        return {"kv_role": "prefill", "kv_transfer_endpoint": tcp_endpoint(ports.transfer)}
    if role == "decode":
        return {"kv_role": "decode", "kv_transfer_peers": ",".join(f"127.0.0.1:{p.transfer}" for p in prefill_ports)}
    return {}


def write_replica_repository(source: Path, destination: Path, ports: ReplicaPorts,
                             overrides: dict[str, str] | None = None) -> Path:
    """``destination`` with the replica's models, `llm` publishing KV events on the replica's ports
    (and its parameters in ``overrides`` changed)."""
    events = {"kv_events_endpoint": tcp_endpoint(ports.events), "kv_events_replay_endpoint": tcp_endpoint(ports.replay)}
    return copy_repository(source, destination, {**(overrides or {}), **events}, REPLICA_MODELS)


def block_size_of(repository: Path) -> int:
    """The `llm` model's KV block size (the router must hash with the same one)."""
    parameters = parameters_from_pbtxt((repository / "llm" / "config.pbtxt").read_text(encoding="utf-8"))
    return int(parameters.get("block_size", 16))


def router_command(replicas: list[ReplicaPorts], policy: str, port: int, prometheus_port: int, block_size: int,
                   host: str = "127.0.0.1", model: str = "llm", log_level: str = "info",
                   session_affinity_ttl: int | None = None, roles: list[str] | None = None,
                   router_temperature: float | None = None) -> list[str]:
    """vllm-router's command line. ``session_affinity_ttl`` (kv_aware only): a session (its
    ``x-session-id`` header) stays on the replica its first request was costed to until it has been
    idle this many seconds; its later turns skip the render calls. ``roles`` (one per replica):
    with prefill and decode replicas, the router's disaggregated mode over them.
    ``router_temperature`` (kv_aware only): the router samples a replica from a softmax of minus
    its costs over this temperature instead of taking the cheapest (0), so equal costs spread over
    the replicas; None: DEFAULT_ROUTER_TEMPERATURE."""
    check_session_affinity(policy, session_affinity_ttl)
    check_router_temperature(policy, router_temperature)
    binary = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")
    if binary is None:
        raise ReplicaError("vllm-router is not installed: `make setup` installs it (pyproject's router extra)")
    roles = roles or ["both"] * len(replicas)
    disaggregated = "prefill" in roles
    if disaggregated:
        if policy not in PD_POLICIES:
            raise ValueError(f"--policy: one of {', '.join(PD_POLICIES)} with --prefill/--decode, got {policy!r}")
        workers = ["--vllm-pd-disaggregation", "--worker-startup-check-interval", "1"]
        for ports, role in zip(replicas, roles, strict=True):
            workers += [f"--{role}", ports.url]
    else:
        workers = ["--worker-urls", *(ports.url for ports in replicas)]
    command = [binary, "--host", host, "--port", str(port), "--policy", policy, *workers,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
               "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_SECONDS), "--health-failure-threshold", "1",
               "--health-check-endpoint", "/health",
               # A replica that failed requests is tried again after this; its launcher has it back in ~10 s.
               "--cb-timeout-duration-secs", str(CIRCUIT_OPEN_SECONDS), "--log-level", log_level]
    if policy == "kv_aware":
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        for ports in replicas:
            command += ["--kv-event-source", f"{ports.url}={tcp_endpoint(ports.events)}",
                        "--kv-event-replay-source", f"{ports.url}={tcp_endpoint(ports.replay)}"]
        if session_affinity_ttl is not None:
            command += ["--kv-aware-session-affinity-ttl-secs", str(session_affinity_ttl)]
        temperature = DEFAULT_ROUTER_TEMPERATURE if router_temperature is None else router_temperature
        command += ["--router-temperature", repr(float(temperature))]
    return command


def replica_cpus(num_replicas: int, cpus: list[int] | None = None) -> list[set[int]]:
    """The CPUs each replica is pinned to: disjoint equal shares of the CPUs this process may use,
    or one CPU each, shared round-robin, when replicas outnumber them. Each engine then runs one
    torch thread per CPU of its share instead of every engine spinning a thread on every CPU."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if num_replicas >= len(cpus):
        return [{cpus[index % len(cpus)]} for index in range(num_replicas)]
    share = len(cpus) // num_replicas
    return [set(cpus[index * share:(index + 1) * share]) for index in range(num_replicas)]


def check_router_temperature(policy: str, router_temperature: float | None) -> None:
    """vllm-router's softmax temperature applies to kv_aware only and must be a finite number >= 0."""
    if router_temperature is None:
        return
    if policy != "kv_aware":
        raise ValueError(f"--router-temperature: only with the kv_aware policy, not {policy}")
    if not 0 <= router_temperature < float("inf"):
        raise ValueError(f"--router-temperature: a finite number >= 0, got {router_temperature}")


def check_session_affinity(policy: str, session_affinity_ttl: int | None) -> None:
    """vllm-router takes a session-affinity TTL of 1 s to a year, and only for kv_aware."""
    if session_affinity_ttl is None:
        return
    if policy != "kv_aware":
        raise ValueError(f"--session-affinity-ttl: only with the kv_aware policy, not {policy}")
    if not 1 <= session_affinity_ttl <= 31_536_000:
        raise ValueError(f"--session-affinity-ttl: 1 to 31536000 seconds, got {session_affinity_ttl}")


class Replicas:
    """The replicas and the router as processes; a context manager that always stops them all."""

    def __init__(self, num_replicas: int = 2, policy: str = "kv_aware", port: int | None = None,
                 model_repository: Path = DEFAULT_MODEL_REPOSITORY, log_dir: Path | None = None,
                 host: str = "127.0.0.1", overrides: dict[str, str] | None = None, router_log_level: str = "info",
                 session_affinity_ttl: int | None = None, pin_cpus: bool = True, num_prefill: int = 0,
                 num_decode: int = 0, router_temperature: float | None = None) -> None:
        """``overrides``: `llm` parameters every replica changes; ``router_log_level`` debug logs each
        routing decision (what the router believes each replica has cached); ``session_affinity_ttl``
        and ``router_temperature``: see :func:`router_command`; ``pin_cpus``: each replica runs on its own CPUs (:func:`replica_cpus`);
        ``num_prefill`` and ``num_decode`` (both, instead of ``num_replicas``): disaggregated serving."""
        if num_prefill or num_decode:
            if num_prefill < 1 or num_decode < 1:
                raise ValueError(f"--prefill and --decode: at least 1 each, got {num_prefill} and {num_decode}")
            num_replicas = num_prefill + num_decode
        if num_replicas < 1:
            raise ValueError(f"--replicas: at least 1, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"--policy: one of {', '.join(POLICIES)}, got {policy!r}")
        self.roles = ["prefill"] * num_prefill + ["decode"] * num_decode or ["both"] * num_replicas
        self.policy = policy
        self.host = host
        self.overrides = dict(overrides or {})
        self.router_log_level = router_log_level
        self.session_affinity_ttl = session_affinity_ttl
        check_session_affinity(policy, session_affinity_ttl)
        self.router_temperature = router_temperature
        check_router_temperature(policy, router_temperature)
        self.port = port or free_port()
        self.source = Path(model_repository).resolve()
        self.work_dir = Path(tempfile.mkdtemp(prefix="replicas-"))
        self.log_dir = Path(log_dir) if log_dir else self.work_dir
        self.ports = [ReplicaPorts.free() for _ in range(num_replicas)]
        self.processes: list[subprocess.Popen | None] = [None] * num_replicas
        self.cpus: list[set[int] | None] = replica_cpus(num_replicas) if pin_cpus else [None] * num_replicas
        self.router: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_path(self, index: int | None) -> Path:
        return self.log_dir / ("router.log" if index is None else f"replica-{index}.log")

    def start_replica(self, index: int) -> None:
        """Starts (or starts again) replica ``index`` on its ports."""
        ports = self.ports[index]
        running = self.processes[index]
        if running is not None and running.poll() is None:
            raise ReplicaError(f"replica {index} is already running (pid {running.pid}); stop it first")
        prefill_ports = [p for p, role in zip(self.ports, self.roles, strict=True) if role == "prefill"]
        defaults = PREFILL_DEFAULTS if self.roles[index] == "prefill" else {}
        overrides = {**defaults, **self.overrides, **role_parameters(self.roles[index], ports, prefill_ports)}
        repository = write_replica_repository(self.source, self.work_dir / f"replica-{index}", ports, overrides)
        command = [sys.executable, "-m", "backend.server.launcher", "--model-repository", str(repository),
                   "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
                   "--openai-port", str(ports.openai), "--",
                   "--model-control-mode=explicit", *(f"--load-model={m}" for m in REPLICA_MODELS)]
        cpus = self.cpus[index]
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        with open(self.log_path(index), "ab") as log:
            self.processes[index] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin)

    def wait_replica(self, index: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not answers_200(f"{self.ports[index].url}/health"):
            process = self.processes[index]
            if process is None or process.poll() is not None or time.monotonic() > deadline:
                raise ReplicaError(f"replica {index} did not become healthy; its log: {self.log_path(index)}\n"
                                   f"{self.log_tail(index)}")
            time.sleep(0.5)

    def stop_replica(self, index: int) -> None:
        """SIGTERM to the replica's launcher, which stops its tritonserver and front."""
        process = self.processes[index]
        if process is not None:
            stop_process_group(process, 60.0)

    def kill_tritonserver(self, index: int) -> int:
        """SIGKILL to replica ``index``'s tritonserver and its stubs, as a crash; its launcher starts
        it again. Returns the killed pid."""
        launcher = self.processes[index]
        if launcher is None:
            raise ReplicaError(f"replica {index} is not running")
        for pid in all_pids():
            stat = read_proc_stat(pid)
            if stat is not None and stat.comm == "tritonserver" and stat.ppid == launcher.pid:
                os.killpg(pid, signal.SIGKILL)
                return pid
        raise ReplicaError(f"replica {index} has no tritonserver running")

    def start(self, timeout: float = 300.0) -> Replicas:
        """Every replica, then the router once they are all healthy."""
        for index in range(len(self.ports)):
            self.start_replica(index)
        for index in range(len(self.ports)):
            self.wait_replica(index, timeout)
        self.start_router()
        return self

    def start_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            raise ReplicaError(f"vllm-router is already running (pid {self.router.pid})")
        command = router_command(self.ports, self.policy, self.port, free_port(), block_size_of(self.source),
                                 host=self.host, log_level=self.router_log_level,
                                 session_affinity_ttl=self.session_affinity_ttl, roles=self.roles,
                                 router_temperature=self.router_temperature)
        with open(self.log_path(None), "ab") as log:
            self.router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
        deadline = time.monotonic() + 60
        while not answers_200(f"{self.url}/health"):
            if self.router.poll() is not None or time.monotonic() > deadline:
                raise ReplicaError(f"vllm-router did not come up; its log:\n{self.log_tail(None)}")
            time.sleep(0.25)

    def log_tail(self, index: int | None, num_chars: int = 4000) -> str:
        path = self.log_path(index)
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self) -> None:
        if self.router is not None:
            stop_process_group(self.router, 10.0)
        # All at once: each launcher may wait out tritonserver's exit timeout.
        with ThreadPoolExecutor(max_workers=len(self.ports)) as pool:
            list(pool.map(self.stop_replica, range(len(self.ports))))
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.server.replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=0, help="disaggregated: prefill replicas (with --decode)")
    parser.add_argument("--decode", type=int, default=0, help="disaggregated: decode replicas (with --prefill)")
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="the router's policy (default: kv_aware; round_robin when disaggregated)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("ROUTER_PORT", 8080)))
    parser.add_argument("--model-repository", type=Path, default=Path(os.environ.get("MODEL_REPOSITORY",
                                                                                      DEFAULT_MODEL_REPOSITORY)))
    parser.add_argument("--log-dir", type=Path, default=None, help="replica and router logs (default: a temporary folder)")
    parser.add_argument("--no-pin-cpus", action="store_true",
                        help="let every replica run on every CPU (default: each on its own share of them)")
    parser.add_argument("--session-affinity-ttl", type=int, default=None, metavar="SECONDS",
                        help="kv_aware: keep a session (x-session-id header) on one replica until idle this long")
    parser.add_argument("--router-temperature", type=float, default=None, metavar="T",
                        help="kv_aware: sample a replica from softmax(-cost / T), 0: always the cheapest "
                             f"(default {DEFAULT_ROUTER_TEMPERATURE:g})")
    args = parser.parse_args(argv)
    stopping = stop_on_signals()
    disaggregated = bool(args.prefill or args.decode)
    policy = args.policy or ("round_robin" if disaggregated else "kv_aware")
    replicas = Replicas(args.replicas, policy, args.port, args.model_repository, args.log_dir, bind_host(),
                        session_affinity_ttl=args.session_affinity_ttl, pin_cpus=not args.no_pin_cpus,
                        num_prefill=args.prefill, num_decode=args.decode, router_temperature=args.router_temperature)
    try:
        print(f"starting {len(replicas.ports)} replicas (logs in {replicas.log_dir})...", flush=True)
        replicas.start()
        print(f"vllm-router ({policy}) on {replicas.url}/v1 over " +
              ", ".join(f"{ports.url} ({role})" for ports, role in zip(replicas.ports, replicas.roles, strict=True)) +
              " (Ctrl-C stops all)", flush=True)
        while not stopping():
            time.sleep(0.5)
    finally:
        replicas.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
