"""The OpenAI-compatible front (openai_front) as a process beside tritonserver, for `make serve`.

It is started once, points at tritonserver's gRPC port (which survives tritonserver restarts: the
front reconnects on its next request), and is started again when it exits on its own, under the
same bound as tritonserver's restarts. It lives in its own process group and is always stopped.
"""

from __future__ import annotations

import subprocess
import sys
import time

from backend.server.process_group import stop_process_group

RESTART_DELAY_SECONDS = 1.0


class OpenAIFront:
    def __init__(self, grpc_port: int, port: int, model: str = "llm", host: str = "127.0.0.1",
                 max_restarts: int = 10):
        self.command = [sys.executable, "-m", "openai_front", "--triton-url", f"127.0.0.1:{grpc_port}",
                        "--model", model, "--host", host, "--port", str(port)]
        self.port = port
        self.max_restarts = max_restarts
        self.restarts = 0
        self.process: subprocess.Popen | None = None
        self._died_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}/v1"

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, start_new_session=True)

    def check(self) -> None:
        """Starts the front again if it exited on its own (after a short delay; bounded)."""
        if self.process is None or self.process.poll() is None:
            return
        if self._died_at is None:
            self._died_at = time.monotonic()
            print(f"the OpenAI front exited with code {self.process.returncode}", file=sys.stderr, flush=True)
        if self.restarts >= self.max_restarts or time.monotonic() - self._died_at < RESTART_DELAY_SECONDS:
            return
        self.restarts += 1
        self._died_at = None
        print(f"starting the OpenAI front again (restart {self.restarts} of at most {self.max_restarts})",
              file=sys.stderr, flush=True)
        self.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None:
            stop_process_group(self.process, timeout)
