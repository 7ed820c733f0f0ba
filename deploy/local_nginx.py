"""Runs deploy/nginx.conf on loopback, in front of tritonservers started by backend.server.launcher.

The compose file's nginx routes to ``triton-N:8001``; tests and benchmarks here have no Docker, so
they render the same file with the upstream servers replaced by ``127.0.0.1:<port>`` lines and the
listen address by a loopback port, keeping every routing directive as it is (``hash`` or the
default round-robin can be chosen for the benchmark's comparison). nginx comes from Debian;
``find_nginx`` installs it with apt-get when it is missing and this process may do so.

``start_nginx_http`` runs the same upstream routing (the same ``hash`` directive) as an HTTP proxy
in front of the replicas' OpenAI fronts instead: what perf/router_bench.py compares vllm-router's
policies with on the same transport (client, one proxy hop, OpenAI front), streaming unbuffered.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NGINX_CONF = Path(__file__).resolve().parent / "nginx.conf"
HASH_DIRECTIVE = "hash $http_x_session_id consistent;"
_SERVERS = re.compile(r"# upstream-servers-begin\n.*?# upstream-servers-end", re.S)
_SERVER_LINE = re.compile(r"^\s*server (\S+) (.*);$", re.M)
_LISTEN = re.compile(r"listen 8001 http2;")


class NginxUnavailable(RuntimeError):
    """nginx is not installed and could not be installed here."""


def find_nginx(install: bool = True) -> str:
    """The nginx binary; installs Debian's package first when missing and we are root with apt."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if found:
        return found
    if not install:
        raise NginxUnavailable("nginx is not installed")
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise NginxUnavailable("nginx is not installed and apt-get is unavailable (or not root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Debian's full "nginx" package: it builds in the grpc module (grpc_pass) that the file needs.
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nginx"]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise NginxUnavailable(f"`{' '.join(command)}` failed: {done.stderr.strip()[-300:]}")
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if not found:
        raise NginxUnavailable("apt-get installed nginx but no nginx binary was found")
    return found


def render(listen_port: int, upstream_ports: list[int], consistent_hash: bool = True,
           temp_dir: Path | None = None, conf_text: str | None = None) -> str:
    """deploy/nginx.conf with loopback upstreams and listen port (routing directives untouched)."""
    text = NGINX_CONF.read_text() if conf_text is None else conf_text
    match = _SERVERS.search(text)
    if match is None or HASH_DIRECTIVE not in text or not _LISTEN.search(text):
        raise ValueError("deploy/nginx.conf lost its upstream markers, hash directive or listen line")
    servers = "\n        ".join(_loopback_servers(match, upstream_ports))
    text = text[: match.start()] + servers + text[match.end():]
    text = _LISTEN.sub(f"listen 127.0.0.1:{listen_port} http2;", text)
    if not consistent_hash:  # round-robin: perf.router_bench's nginx-round-robin, the baseline of the hash
        text = text.replace(HASH_DIRECTIVE, "# round-robin (no hash)")
    return _with_temp_paths(text, temp_dir)


def _loopback_servers(servers_block: re.Match, upstream_ports: list[int]) -> list[str]:
    """One upstream ``server`` line per port, with the options (max_fails/fail_timeout) the file gives."""
    options = _SERVER_LINE.findall(servers_block.group(0))[0][1]
    return [f"server 127.0.0.1:{port} {options};" for port in upstream_ports]


def _with_temp_paths(text: str, temp_dir: Path | None) -> str:
    """The distribution's compiled-in temp folders may not be writable: put them under ``temp_dir``."""
    if temp_dir is None:
        return text
    temps = "".join(f"    {kind}_temp_path {temp_dir / kind};\n"
                    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return text.replace("http {\n", "http {\n" + temps, 1)


HTTP_CONF = """worker_processes 1;
pid nginx.pid;

events {
    worker_connections 1024;
}

http {
    access_log off;

    upstream openai_http {
        %(hash)s
        %(servers)s
        keepalive 64;
    }

    server {
        listen 127.0.0.1:%(port)d;
        client_max_body_size 64m;

        location / {
            proxy_pass http://openai_http;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
            proxy_connect_timeout 2s;
            proxy_next_upstream error timeout http_502 http_503;
            proxy_next_upstream_tries 2;
        }
    }
}
"""


def render_http(listen_port: int, upstream_ports: list[int], temp_dir: Path | None = None) -> str:
    """An HTTP (OpenAI front) proxy with deploy/nginx.conf's routing: its hash and server options."""
    grpc_conf = NGINX_CONF.read_text()
    match = _SERVERS.search(grpc_conf)
    if match is None or HASH_DIRECTIVE not in grpc_conf:
        raise ValueError("deploy/nginx.conf lost its upstream markers or hash directive")
    servers = "\n        ".join(_loopback_servers(match, upstream_ports))
    return _with_temp_paths(HTTP_CONF % {"hash": HASH_DIRECTIVE, "servers": servers, "port": listen_port}, temp_dir)


def _port_open(port: int) -> bool:
    with contextlib.closing(socket.socket()) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class LocalNginx:
    """An nginx master process (and its worker) in its own process group; stop() always kills it."""

    process: subprocess.Popen
    listen_port: int
    prefix: Path
    _owns_prefix: bool = True

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    def log_tail(self, num_chars: int = 3000) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)  # fast shutdown of master and workers
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # a worker must not outlive its master
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        if self._owns_prefix:
            shutil.rmtree(self.prefix, ignore_errors=True)

    def __enter__(self) -> LocalNginx:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_nginx(listen_port: int, upstream_ports: list[int], consistent_hash: bool = True,
                nginx_binary: str | None = None, ready_timeout: float = 15.0) -> LocalNginx:
    """Starts nginx in the foreground (``daemon off``) on ``listen_port``; returns once it listens."""
    return _start(lambda prefix: render(listen_port, upstream_ports, consistent_hash, temp_dir=prefix),
                  listen_port, nginx_binary, ready_timeout)


def start_nginx_http(listen_port: int, upstream_ports: list[int], nginx_binary: str | None = None,
                     ready_timeout: float = 15.0) -> LocalNginx:
    """``render_http``'s proxy on ``listen_port`` in front of OpenAI fronts on ``upstream_ports``."""
    return _start(lambda prefix: render_http(listen_port, upstream_ports, temp_dir=prefix),
                  listen_port, nginx_binary, ready_timeout)


def _start(conf_text, listen_port: int, nginx_binary: str | None, ready_timeout: float) -> LocalNginx:
    binary = nginx_binary or find_nginx()
    prefix = Path(tempfile.mkdtemp(prefix="nginx-"))
    conf = prefix / "nginx.conf"
    conf.write_text(conf_text(prefix))
    command = [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log"),
               "-g", f"daemon off; error_log {prefix / 'error.log'} info;"]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, start_new_session=True)
    server = LocalNginx(process, listen_port, prefix)
    deadline = time.monotonic() + ready_timeout
    while not _port_open(listen_port):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"nginx did not start on port {listen_port}:\n{tail}")
        time.sleep(0.05)
    return server
