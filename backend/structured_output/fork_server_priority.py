"""The compile worker's fork server lowers its own CPU priority before it imports anything heavy, and
does not outlive the engine that started it while it imports.

Imported by that fork server alone, first of its preload list (compile_worker._PRELOAD), never by
the engine: importing it lowers the priority of the process that imports it. Why: the fork server's
first start imports xgrammar and torch, seconds of CPU that an engine start, and a model's recovery
after its stub died, spend beside it; at the worker's priority that import takes what the engine
core's start and first steps leave, as the compiles do. The workers it forks inherit the priority.

multiprocessing's fork server notices its parent's exit (the end of its ``alive_r`` pipe) only in
its serving loop, after the preload; at a low priority on a busy machine the preload can take tens
of seconds, so an engine stopped soon after its start would leave the fork server behind,
importing. A daemon thread waits on that same pipe from the start and ends the process at its EOF.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import select
import sys
import threading

from backend.structured_output.compile_worker import lower_priority


def _alive_pipe() -> int | None:
    """The fork server's ``alive_r``: the read end of a pipe whose write end only its parent holds.
    Read from the frame of ``multiprocessing.forkserver.main``, which is importing this module."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return frame.f_locals.get("alive_r")
        frame = frame.f_back
    return None


def _exit_at_eof(alive_r: int) -> None:
    select.select([alive_r], [], [])  # readable only at EOF: the parent never writes
    os._exit(0)


lower_priority()
if (pipe := _alive_pipe()) is not None:
    threading.Thread(target=_exit_at_eof, args=(pipe,), name="exit-with-the-engine", daemon=True).start()
