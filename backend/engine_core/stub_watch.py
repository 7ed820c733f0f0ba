"""What the engine core does when the front end's process (the Python-backend stub) dies under it.

Triton 2.51's Python backend restarts the stub of a non-decoupled model on its next request, but
never the stub of a decoupled one (python_backend's ``TRITONBACKEND_ModelInstanceExecute``: "TODO:
Implement restart on decoupled"; server#7862). Measured here: after a SIGKILL of the `llm` stub,
its streams hang for good (still after an unload and a load), the model stays
READY, and every new request hangs too: the response factories live in tritonserver, and no
process but the dead stub can answer them. Only tritonserver's exit ends those streams.

So a core whose stub died while the model is still READY (not an unload, not a server stop: those
stop the core first, or make the model unready) asks tritonserver to stop (SIGTERM). Triton then
refuses new requests, lets the other models' requests finish within ``--exit-timeout-secs`` and
exits, which ends every hung stream with an error. Measured: with the dead stub's streams open,
tritonserver logs "Exit timeout expired. Exiting immediately." and then does not exit; so a small
process (``python -m backend.engine_core.stub_watch PID SECONDS``, in the server's process group)
SIGKILLs tritonserver when it is still there ``kill_after_seconds`` after the SIGTERM, and the core
itself exits at once. Its supervisor (Docker's restart policy,
Kubernetes, ``python -m backend.server.launcher``) starts it again. vLLM's API server does the same when
its engine core dies: it shuts down so that its supervisor restarts it. ``on_stub_death: ignore``
keeps the old behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from backend.paths import REPO_ROOT

logger = logging.getLogger("backend.engine_core")

PROBE_TIMEOUT_SECONDS = 2.0
POLL_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class StubWatch:
    """Who to stop when the stub dies (tritonserver's pid), and the URL that says whether the model
    is still meant to be serving (Triton's ``/v2/models/NAME[/versions/V]/ready``)."""

    server_pid: int
    ready_url: str
    kill_after_seconds: float = 35.0  # Triton's exit timeout (30 s by default) and a margin


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
    """Called once the core's parent is gone; returns whether it asked tritonserver to stop."""
    if watch is None or not process_alive(watch.server_pid) or not model_still_ready(watch.ready_url):
        return False
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
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return not process_alive(pid)


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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"engine-core-stub-watch[{os.getpid()}] %(levelname)s: %(message)s")
    sys.exit(kill_when_stuck(int(sys.argv[1]), float(sys.argv[2])))
