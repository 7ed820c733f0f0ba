"""Where a result came from: git commit, machine, and the served model's configuration.

Recorded in every JSON report so numbers can be compared only with numbers from the same code,
machine and config.pbtxt parameters.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import tritonclient.grpc as grpcclient

# The checkout this client runs from (client/ and data/ ship in one repository): its commit is
# what a report records, and data/ holds the default corpus.
CHECKOUT = Path(__file__).resolve().parents[2]


def git_state(repo: Path = CHECKOUT) -> dict:
    """Commit hash and whether tracked files differ from it (None when git is unavailable)."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


RUNTIME_ENVIRONMENT = ("LD_PRELOAD", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY",
                       "GOMP_SPINCOUNT", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "KMP_BLOCKTIME", "MALLOC_ARENA_MAX")


def runtime_settings() -> dict:
    """The thread and allocator settings a result was measured under (what the launcher and the
    environment set), so every benchmark result records them."""
    settings = {name: os.environ[name] for name in RUNTIME_ENVIRONMENT if name in os.environ}
    try:
        import torch  # noqa: PLC0415 (process: client.bench's runners import this module through workload and prompts; torch loads only in a process that writes a result, when it writes it)

        settings["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return settings


def machine_info() -> dict:
    return {
        "runtime": runtime_settings(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": sys.version.split()[0],
        "hostname": platform.node(),
    }


def server_model_config(url: str, model: str) -> dict:
    """The served model's config (parameters, batching) via gRPC; {'error': ...} when unavailable."""
    try:
        client = grpcclient.InferenceServerClient(url=url)
        try:
            config = client.get_model_config(model, as_json=True).get("config", {})
            metadata = client.get_server_metadata(as_json=True)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 (a report without the config beats no report)
        return {"error": str(exc)}
    parameters = {k: v.get("string_value") for k, v in config.get("parameters", {}).items()}
    return {
        "name": config.get("name"),
        "backend": config.get("backend"),
        "max_batch_size": config.get("max_batch_size"),
        "dynamic_batching": config.get("dynamic_batching"),
        "instance_group": config.get("instance_group"),
        "parameters": parameters,
        "server": {"name": metadata.get("name"), "version": metadata.get("version")},
    }


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
