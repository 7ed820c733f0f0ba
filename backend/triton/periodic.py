"""A daemon thread that calls a function every few seconds until stopped (the glue's watchers)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeriodicThread:
    """Calls ``tick()`` every ``interval_s`` until ``stop()`` or until ``tick()`` returns True.

    An exception in ``tick`` is logged and the thread goes on. The watchers subclass it and pass
    their own method as ``tick``.
    """

    def __init__(self, tick: Callable[[], bool | None], interval_s: float, name: str):
        self._tick = tick
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                if self._tick():
                    return
            except Exception:
                logger.exception("%s failed", self._thread.name)
