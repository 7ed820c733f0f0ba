"""What the engine core does when the front end's process (the Python-backend stub) dies under it.

Triton 2.51's Python backend restarts the stub of a non-decoupled model on its next request, but
never the stub of a decoupled one (python_backend's ``TRITONBACKEND_ModelInstanceExecute``: "TODO:
Implement restart on decoupled"; server#7862). Measured here: after a SIGKILL of the `llm` stub,
its streams hang for good (still after an unload and a load), the model stays
READY, and every new request hangs too: the response factories live in tritonserver, and no
process but the dead stub can answer them. Only tritonserver's exit ends those streams.

So a core whose stub died while the model is still READY (not an unload, not a server stop: those
stop the core first, or make the model unready) acts, as config.pbtxt ``on_stub_death`` says.

``reload`` (the default where tritonserver runs with ``--model-control-mode=explicit``, as our
launcher starts it): a small process of its own (``python -m backend.engine_core.stub_watch
reload ...``) unloads and loads the model through Triton's model-control API, so only this model is
down, for as long as its load takes; the core exits at once (its KV memory goes before the new
core's is taken). Each recovery is written to a small record beside tritonserver's pid
(``recovery_record_path``) that the new stub turns into ``llm_stub_recoveries_total``; a crash loop
backs off (the n-th recovery within ``CRASH_LOOP_WINDOW_SECONDS`` waits ``2 ** (n - 2)`` s, at most
``MAX_BACKOFF_SECONDS``). What reload cannot do is end the gRPC streams the dead stub held: they
stay open in tritonserver until their client gives up (the OpenAI front ends its own with a 503,
openai_front/orphan_watch.py).

``stop_server`` (the fallback without explicit model control) asks tritonserver to stop (SIGTERM). Triton then
refuses new requests, lets the other models' requests finish within ``--exit-timeout-secs`` and
exits, which ends every hung stream with an error. Measured: with the dead stub's streams open,
tritonserver logs "Exit timeout expired. Exiting immediately." and then does not exit; so a small
process (``python -m backend.engine_core.stub_watch PID SECONDS``, in the server's process group)
SIGKILLs tritonserver when it is still there ``kill_after_seconds`` after the SIGTERM, and the core
itself exits at once. Its supervisor (Docker's restart policy,
Kubernetes, ``python -m backend.server.launcher``) starts it again. vLLM's API server does the same when
its engine core dies: it shuts down so that its supervisor restarts it. This ends every stream with
an error, at the price of the whole server. ``on_stub_death: ignore`` does nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from backend.paths import REPO_ROOT
from backend.proc_stat import read_proc_stat

logger = logging.getLogger("backend.engine_core")

PROBE_TIMEOUT_SECONDS = 2.0
POLL_SECONDS = 0.2
CRASH_LOOP_WINDOW_SECONDS = 300.0  # recoveries this recent count towards the back-off
MAX_BACKOFF_SECONDS = 60.0
LOAD_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class StubWatch:
    """Who to stop when the stub dies (tritonserver's pid), and the URL that says whether the model
    is still meant to be serving (Triton's ``/v2/models/NAME[/versions/V]/ready``)."""

    server_pid: int
    ready_url: str
    kill_after_seconds: float = 35.0  # Triton's exit timeout (30 s by default) and a margin
    reload_model: str = ""  # on_stub_death reload: this model is unloaded and loaded; "": stop the server
    http_url: str = ""  # Triton's HTTP endpoint, for the reload


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def model_still_ready(url: str) -> bool:
    """True only when Triton answers 200: anything else (unready, unreachable) means an unload or
    a stop is under way, or that we cannot tell, and then the server is left alone."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_SECONDS) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def on_stub_death(watch: StubWatch | None) -> bool:
    """Called once the core's parent is gone; returns whether it started a recovery (a reload, or
    a server stop)."""
    if watch is None or not process_alive(watch.server_pid) or not model_still_ready(watch.ready_url):
        return False
    if watch.reload_model:
        logger.error("the model's Python-backend stub died while the model was serving; Triton does not restart "
                     "the stub of a decoupled model, so model '%s' is unloaded and loaded again", watch.reload_model)
        subprocess.Popen([sys.executable, "-m", "backend.engine_core.stub_watch", "reload", watch.http_url,
                          watch.reload_model, str(watch.server_pid)], stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
        return True
    logger.error("the model's Python-backend stub died while the model was serving; Triton does not restart "
                 "the stub of a decoupled model and its streams would hang for good, so tritonserver (pid %d) "
                 "is asked to stop (SIGTERM) for its supervisor to restart it", watch.server_pid)
    try:
        os.kill(watch.server_pid, signal.SIGTERM)
    except OSError as exc:
        logger.error("could not signal tritonserver: %s", exc)
        return False
    # The core exits now (its KV cache memory goes with it); a small process of its own waits.
    subprocess.Popen([sys.executable, "-m", "backend.engine_core.stub_watch", str(watch.server_pid),
                      str(watch.kill_after_seconds)], stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
    return True


def process_gone(pid: int) -> bool:
    """Gone, or a zombie (exited, not yet reaped by its parent)."""
    stat = read_proc_stat(pid)
    if stat is None:
        return not process_alive(pid)
    return stat.zombie


def kill_when_stuck(pid: int, seconds: float) -> int:
    """SIGKILLs ``pid`` when it is still there after ``seconds``; returns 1 if it had to."""
    deadline = time.monotonic() + seconds
    while not process_gone(pid):
        if time.monotonic() > deadline:
            logger.error("tritonserver (pid %d) did not exit %g s after SIGTERM: killing it", pid, seconds)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            return 1
        time.sleep(POLL_SECONDS)
    return 0


def process_start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot; 0 when unreadable): with the pid it names one
    process, where a pid alone is reused by a later one."""
    stat = read_proc_stat(pid)
    return stat.start_ticks if stat is not None else 0


def recovery_record_path(server_pid: int, model: str) -> str:
    """Where the recoveries of ``model`` in this tritonserver are recorded (one JSON list of times);
    a later server that gets the same pid does not read them."""
    safe = urllib.parse.quote(model, safe="")
    started = process_start_ticks(server_pid)
    return os.path.join(tempfile.gettempdir(), f"triton-llm-stub-recoveries-{server_pid}-{started}-{safe}.json")


def recorded_recoveries(server_pid: int, model: str) -> list[float]:
    """The wall-clock times of this model's recoveries in this server (empty when none or unreadable)."""
    try:
        with open(recovery_record_path(server_pid, model)) as handle:
            times = json.load(handle)
        return [float(t) for t in times] if isinstance(times, list) else []
    except (OSError, ValueError, TypeError):
        return []


def backoff_seconds(recoveries: list[float], now: float) -> float:
    """How long the next recovery waits: none for the first in the window, then 1, 2, 4... s."""
    recent = sum(1 for t in recoveries if now - t < CRASH_LOOP_WINDOW_SECONDS)
    return 0.0 if recent == 0 else min(2.0 ** (recent - 1), MAX_BACKOFF_SECONDS)


def _model_control(http_url: str, model: str, action: str, timeout: float) -> None:
    url = f"{http_url.rstrip('/')}/v2/repository/models/{urllib.parse.quote(model, safe='')}/{action}"
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


def reload_model(http_url: str, model: str, server_pid: int) -> int:
    """Unloads and loads ``model`` (after the crash-loop back-off); retries the load while the
    server lives. Returns 0 once the model is loaded, 1 when the server went away first."""
    recoveries = recorded_recoveries(server_pid, model)
    wait = backoff_seconds(recoveries, time.time())
    if wait:
        logger.warning("model '%s': recovery %d within %.0f s: backing off %.0f s", model, len(recoveries) + 1,
                       CRASH_LOOP_WINDOW_SECONDS, wait)
        time.sleep(wait)
    record = recovery_record_path(server_pid, model)
    recoveries.append(time.time())
    with open(record + ".tmp", "w") as handle:
        json.dump(recoveries[-100:], handle)
    os.replace(record + ".tmp", record)
    attempt_wait = 1.0
    while process_alive(server_pid) and not process_gone(server_pid):
        try:
            _model_control(http_url, model, "unload", PROBE_TIMEOUT_SECONDS * 5)
            started = time.monotonic()
            _model_control(http_url, model, "load", LOAD_TIMEOUT_SECONDS)
            logger.warning("model '%s' reloaded in %.1f s after its stub died", model, time.monotonic() - started)
            return 0
        except (urllib.error.URLError, OSError) as exc:
            logger.error("reloading model '%s' failed (%s); retrying in %.0f s", model, exc, attempt_wait)
            time.sleep(attempt_wait)
            attempt_wait = min(attempt_wait * 2, MAX_BACKOFF_SECONDS)
    return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"engine-core-stub-watch[{os.getpid()}] %(levelname)s: %(message)s")
    if sys.argv[1] == "reload":
        sys.exit(reload_model(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit(kill_when_stuck(int(sys.argv[1]), float(sys.argv[2])))
