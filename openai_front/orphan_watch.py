"""Ends a generation whose Triton model was reloaded under it: its stream would never answer.

Triton 2.51 neither restarts a dead decoupled stub nor ends the gRPC streams it held: they stay
open after the `llm` model reloads (backend/engine_core/stub_watch.py brings the model back), and
nothing but the dead stub could answer them. A generation that has heard nothing for
``ORPHAN_CHECK_SECONDS`` asks whether the model is ready, at most once per that interval; once it
has seen the model unready and then ready again while it still heard nothing, the model it was sent
to is gone, and it ends with a 503 the client can retry. A graceful unload does not trip it: its
streams get their answers (or the drain's error) before the model is unloaded and loaded again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from openai_front.errors import ApiError

ORPHAN_CHECK_SECONDS = 1.0
ORPHANED_MESSAGE = ("the model was reloaded while this request was in flight (its backend process had "
                    "died): the request is lost; retry it")


class OrphanWatch:
    def __init__(self, ready: Callable[[], Awaitable[bool]]):
        self._ready = ready
        self._saw_unready = False
        self._last_check = 0.0

    def heard(self) -> None:
        """A piece came: whatever the model did meanwhile, this stream is alive."""
        self._saw_unready = False

    async def check(self) -> None:
        """Raises the orphaned 503 (see the module docstring); probes at most once per interval."""
        now = time.monotonic()
        if now - self._last_check < ORPHAN_CHECK_SECONDS:
            return
        self._last_check = now
        if not await self._ready():
            self._saw_unready = True
        elif self._saw_unready:
            raise ApiError(503, ORPHANED_MESSAGE, None, "service_unavailable", "model_reloaded")
