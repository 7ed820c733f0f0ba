"""How a child process ended, in words, from its exit status (negative: the signal that killed it):
what the engine core's front end, the tensor-parallel driver and the grammar compile worker's owner
put in their errors and logs."""

from __future__ import annotations

import signal


def describe_exit_code(code: int) -> str:
    """'was killed by SIGKILL', 'exited with code 3'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
