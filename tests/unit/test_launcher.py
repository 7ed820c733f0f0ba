"""The launcher's layout, environment and readiness wait, checked without starting a server."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

from backend.server.launcher import (
    TritonServer,
    find_tritonserver,
    free_port,
    prepare_backend_directory,
    python_stub_tag,
    server_environment,
)


def test_backend_directory_holds_the_stub_for_this_python(tmp_path):
    installation = find_tritonserver()
    backend_dir = prepare_backend_directory(installation, tmp_path)
    if installation.wheel_root is None:  # NGC image: tritonserver's own backends are used
        assert backend_dir is None
        return
    stub = backend_dir / "python" / "triton_python_backend_stub"
    assert stub.exists() and os.access(stub, os.X_OK)
    source = installation.wheel_root / "python_backend_stubs" / python_stub_tag() / "triton_python_backend_stub"
    assert stub.read_bytes() == source.read_bytes()
    assert (backend_dir / "python" / "libtriton_python.so").exists()


def test_environment_puts_this_venv_first_and_libpython_on_the_library_path():
    installation = find_tritonserver()
    env = server_environment(installation, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    library_dirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert library_dirs[0] == sysconfig.get_config_var("LIBDIR")
    assert library_dirs[-1] == "/opt/x"
    if installation.wheel_root is not None:
        assert any(d.endswith("nvidia_pytriton.libs") for d in library_dirs)


class _Answer200(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve_in_thread(port: int) -> http.server.HTTPServer:
    server = http.server.HTTPServer(("127.0.0.1", port), _Answer200)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_wait_ready_waits_for_the_metrics_endpoint_that_triton_starts_after_http(tmp_path):
    """Triton answers ready before its metrics port listens: wait_ready holds until both answer,
    and returns at once when metrics are off."""
    http_port, metrics_port = free_port(), free_port()
    process = subprocess.Popen(["sleep", "60"])
    servers = [_serve_in_thread(http_port)]
    try:
        server = TritonServer(process, http_port, free_port(), metrics_port, None, tmp_path, _owns_work_dir=False)
        assert server.is_ready() and not server.metrics_answer()
        threading.Timer(1.0, lambda: servers.append(_serve_in_thread(metrics_port))).start()
        started = time.monotonic()
        server.wait_ready(timeout=30)
        assert time.monotonic() - started >= 0.9 and server.metrics_answer()
        no_metrics = TritonServer(process, http_port, free_port(), free_port(), None, tmp_path,
                                  _owns_work_dir=False, metrics_enabled=False)
        started = time.monotonic()
        no_metrics.wait_ready(timeout=30)
        assert time.monotonic() - started < 0.9
    finally:
        for served in servers:
            served.shutdown()
            served.server_close()
        process.kill()
        process.wait()
