"""Live progress of a run: a line every few seconds with done/total, errors and current tok/s.

Workers call ``add_tokens`` from gRPC callback threads and ``finish`` once per request; a
background thread prints. "now" is the output-token rate over the last interval, "avg" since start.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, interval_s: float = 5.0, stream: TextIO | None = None,
                 eta: bool = False):
        """``eta``: each line also says when the run should end, at the average pace so far."""
        self.label = label
        self.eta = eta
        self.total = total
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stdout
        self._lock = threading.Lock()
        self._done = 0
        self._errors = 0
        self._tokens = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def add_tokens(self, count: int) -> None:
        with self._lock:
            self._tokens += count

    def finish(self, failed: bool) -> None:
        with self._lock:
            self._done += 1
            self._errors += int(failed)

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self._done, self._errors, self._tokens

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._report_periodically, name="bench-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._print_line(None, None)

    def _report_periodically(self) -> None:
        last_time, last_tokens = self._start, 0
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            _, _, tokens = self.snapshot()
            self._print_line((tokens - last_tokens) / max(now - last_time, 1e-9), now)
            last_time, last_tokens = now, tokens

    def _print_line(self, current_rate: float | None, now: float | None) -> None:
        now = now if now is not None else time.monotonic()
        done, errors, tokens = self.snapshot()
        elapsed = now - self._start
        rate = f"{current_rate:.1f} tok/s now, " if current_rate is not None else ""
        eta = ""
        if self.eta and current_rate is not None:
            eta = f", ETA {elapsed / done * (self.total - done):.0f} s" if done else ", ETA unknown"
        print(
            f"[{self.label}] {done}/{self.total} done, {errors} errors, {rate}"
            f"{tokens / max(elapsed, 1e-9):.1f} tok/s avg, {elapsed:.1f} s{eta}",
            file=self.stream, flush=True,
        )
