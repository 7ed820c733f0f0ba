"""Notices that Triton is unloading this model (server shutdown or an explicit unload) and drains.

Triton gives a decoupled Python model no call when the server gets SIGTERM: it stops taking new
requests at its front ends, marks every model UNLOADING and waits (``--exit-timeout-secs``, 30 s by
default) for requests in flight, and calls ``finalize()`` only once they are all done. A model that
just keeps generating has its clients' streams cut when that timeout (or a process manager's kill)
comes. So a watcher thread asks Triton's HTTP endpoint whether this model version is ready: once
it has been ready and then is not, the engine client drains (no new requests, a grace period for
those in flight, then an error that names the shutdown). A reload that swaps in a new copy keeps
the version ready, so the old copy just finishes its requests.

Why HTTP and not ``pb_utils.is_model_ready``: measured on Triton 2.51, calling it from a thread
while requests run aborts tritonserver (``boost::interprocess::lock_exception`` in the Python
backend's execute path), within seconds under load. The URL comes from the parameter
``triton_http_url``, else from tritonserver's own command line (our parent process): its
``--http-port`` (default 8000) on loopback; ``--allow-http=false`` or a parent that is not
tritonserver turns draining off (logged).
"""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from backend.triton.periodic import PeriodicThread

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.25
PROBE_TIMEOUT_SECONDS = 2.0


def tritonserver_options(argv: list[str]) -> dict[str, str] | None:
    """tritonserver's ``--name=value`` and ``--name value`` options from its argv; None when the
    argv is not tritonserver's."""
    if not argv or "tritonserver" not in os.path.basename(argv[0]):
        return None
    options: dict[str, str] = {}
    index = 1
    while index < len(argv):
        arg = argv[index]
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            options[key] = value
        elif arg.startswith("--") and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            options[arg[2:]] = argv[index + 1]
            index += 1
        index += 1
    return options


def exit_timeout_from_command_line(argv: list[str]) -> float:
    """tritonserver's ``--exit-timeout-secs`` (30 by default)."""
    try:
        return float((tritonserver_options(argv) or {}).get("exit-timeout-secs", 30))
    except ValueError:
        return 30.0


def http_url_from_command_line(argv: list[str]) -> str | None:
    """Triton's HTTP endpoint on loopback, from tritonserver's argv; None when HTTP is off."""
    options = tritonserver_options(argv)
    if options is None:
        return None
    if options.get("allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    address = options.get("http-address", "0.0.0.0")
    host = "127.0.0.1" if address in ("0.0.0.0", "", "::") else address
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{options.get('http-port', '8000')}"


def parent_command_line() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return [part.decode("utf-8", "replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []


def readiness_url(base_url: str, model_name: str, model_version: str) -> str:
    """Triton's ``/v2/models/NAME[/versions/V]/ready`` under ``base_url``."""
    path = f"/v2/models/{urllib.parse.quote(model_name)}"
    if model_version:
        path += f"/versions/{urllib.parse.quote(model_version)}"
    return base_url.rstrip("/") + path + "/ready"


def http_readiness_probe(url: str) -> Callable[[], bool | None]:
    """A callable: True when Triton says the version at ``url`` (see readiness_url) is ready, False
    when it says not (or its HTTP endpoint is gone), None when it could not tell (a timeout)."""

    def probe() -> bool | None:
        try:
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_SECONDS) as response:
                return response.status == 200
        except urllib.error.HTTPError:
            return False
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                return False
            return None
        except (TimeoutError, OSError):
            return None

    return probe


class UnloadWatcher(PeriodicThread):
    """Calls ``on_unload()`` once, from a daemon thread, when ``is_ready()`` turns False after True.

    ``is_ready`` returns True, False, or None (cannot tell: keep the last answer).
    """

    def __init__(self, is_ready: Callable[[], bool | None], on_unload: Callable[[], None],
                 poll_seconds: float = POLL_SECONDS):
        super().__init__(self._poll, poll_seconds, "llm-unload-watcher")
        self._is_ready = is_ready
        self._on_unload = on_unload
        self._seen_ready = False

    def _poll(self) -> bool:
        try:
            ready = self._is_ready()
        except Exception:
            logger.debug("readiness probe failed", exc_info=True)
            return False
        if ready:
            self._seen_ready = True
        elif ready is False and self._seen_ready:
            logger.warning("Triton is unloading this model: draining")
            self._on_unload()
            return True  # done: a model is unloaded once
        return False
