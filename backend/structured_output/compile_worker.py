"""The grammar compile worker: one process that compiles one constraint at a time, so a compile that
runs past its time is killed (xgrammar cannot stop one) and the engine core's CPU is freed.

Workers are forked by multiprocessing's fork server, never by the engine core itself (it has
torch's threads): the server is a fresh interpreter that imported xgrammar once, so the first
worker costs that import and the next ones (a restart after a kill, a second engine) a fork. As
with any start method but fork, a script that builds an engine needs ``if __name__ == "__main__":``.

A worker gets the engine's ``xgrammar.TokenizerInfo`` as JSON, so it compiles against exactly the
engine's vocabulary, and keeps to one thread (xgrammar's and torch's). It runs at a low CPU
priority (``NICE``), as does the fork server from its first import on (fork_server_priority.py):
a compile takes mostly what the engine's steps leave, which is why its timeout
counts its CPU time, not the wall clock. For each constraint it answers with xgrammar's error, or
with the compiled grammar (``CompiledGrammar.serialize_json``, which the engine reads back with its
own TokenizerInfo) when that is small (``SHIP_BYTES``). The text grows much faster than the compile
(a large schema's runs to hundreds of MB, slower to write and read than to compile), so for a larger
grammar it answers only that it compiled, and the engine compiles it again itself, bounded work
now (backend/structured_output/compiler.py). It exits when its connection closes and, on Linux, when
its parent does (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import resource_tracker

from backend.paths import python_executable
from backend.proc_stat import read_proc_stat
from backend.process_exit import describe_exit_code
from backend.protocol.structured_output import (
    StructuredOutputError,
    StructuredOutputSpec,
    to_grammar,
    xgrammar_message,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 120.0  # the fork server's first start imports xgrammar (and torch)
STALL_FACTOR = 3  # a compile's wall time may be this many times its CPU timeout (a busy machine)
POLL_SECONDS = 0.05  # how often the worker's CPU time is read during a compile
NICE = 10  # the worker yields the CPU to the engine's steps, and still gets some on a busy machine
SHIP_BYTES = 256 * 1024  # a compiled grammar's JSON up to this size is sent back; a larger one is compiled again
# The fork server imports these in order: first its lower priority, then the heavy imports.
_PRELOAD = ["backend.structured_output.fork_server_priority", "xgrammar", "backend.structured_output.compile_worker"]


class CompileWorkerError(RuntimeError):
    """The worker could not be started; the message says why."""


class CompileTimeout(StructuredOutputError):
    """The compile ran past the timeout; the worker was killed."""


class CompileInterrupted(StructuredOutputError):
    """The compile ended for a reason that may not be the constraint's: its worker died (killed from
    outside, or crashed), or the machine was too busy to run it."""


class CompileWorker:
    """The engine's handle on one worker process at a time. Not thread-safe: one thread starts it and
    sends the compiles; ``interrupt`` may come from any thread."""

    def __init__(self, tokenizer_info_json: str):
        self._tokenizer_info = tokenizer_info_json.encode("utf-8")
        self._process = None
        self._connection = None
        self.num_starts = 0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> float:
        """Starts a worker and waits until it is ready; returns the seconds it took. Raises
        CompileWorkerError (and leaves nothing running)."""
        self.kill()
        started = time.perf_counter()
        context = _context()
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(child, os.getpid()), name="grammar-compile-worker",
                                  daemon=True)
        try:
            process.start()
        except Exception as exc:
            parent.close()
            raise CompileWorkerError(f"the grammar compile worker could not start ({type(exc).__name__}: {exc})") from None
        finally:
            child.close()
        self._process, self._connection = process, parent
        try:
            parent.send_bytes(self._tokenizer_info)
            if not parent.poll(timeout):
                raise CompileWorkerError(f"the grammar compile worker was not ready after {timeout:g} s")
            parent.recv()  # "ready"
        except (OSError, EOFError):
            process.join(1.0)
            self.kill()
            raise CompileWorkerError(f"the grammar compile worker {self._describe_exit(process)} before it was ready "
                                     "(its error is in this process's log)") from None
        except CompileWorkerError:
            self.kill()
            raise
        self.num_starts += 1
        return time.perf_counter() - started

    def compile(self, spec: StructuredOutputSpec, timeout: float) -> str | None:
        """Compiles ``spec`` in the worker; returns the compiled grammar's JSON
        (``CompiledGrammar.serialize_json``), or None when it is too large to be worth sending.

        ``timeout`` counts the worker's CPU seconds (the constraint's own cost, whatever the load),
        and, as a backstop for a machine too busy to give it any, ``STALL_FACTOR`` times as many
        seconds of wall time. Raises StructuredOutputError (xgrammar's error), CompileTimeout or
        CompileInterrupted (the worker is killed for both), each naming ``spec.key``.
        """
        process, connection = self._process, self._connection
        if process is None:
            raise CompileInterrupted(f"{spec.key}: the grammar compile worker is not running")
        try:
            started = time.monotonic()
            cpu_start = _cpu_seconds(process.pid)
            stall_at = started + STALL_FACTOR * timeout
            connection.send(spec)
            while not connection.poll(POLL_SECONDS):
                if _used_seconds(process.pid, cpu_start, started) >= timeout:
                    self.kill()
                    raise CompileTimeout(f"{spec.key}: did not compile within {timeout:g} s "
                                         "(parameter structured_output_compile_timeout_seconds)")
                if time.monotonic() >= stall_at:
                    self.kill()
                    raise CompileInterrupted(
                        f"{spec.key}: did not compile within {STALL_FACTOR * timeout:g} s: the machine is too busy "
                        "to compile it now (parameter structured_output_compile_timeout_seconds)")
            error, text = connection.recv()
        except (OSError, EOFError):
            process.join(1.0)
            self.kill()
            raise CompileInterrupted(f"{spec.key}: the grammar compile worker {self._describe_exit(process)} while "
                                     "compiling it") from None
        if error is not None:
            raise StructuredOutputError(f"{spec.key}: does not compile: {error}")
        return text

    def interrupt(self) -> None:
        """SIGKILL to the worker running now, from any thread; the thread sending compiles reaps it."""
        pid = self.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Ends the worker at once (SIGKILL: a compile never looks at signals) and reaps it."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(5.0)

    @staticmethod
    def _describe_exit(process) -> str:
        code = process.exitcode
        if code is None:
            return "stopped answering"
        return describe_exit_code(code)


def _cpu_seconds(pid: int) -> float | None:
    """The process's CPU time (user + system) from /proc; None where it cannot be read."""
    stat = read_proc_stat(pid)
    return stat.cpu_seconds if stat is not None else None


def _used_seconds(pid: int, cpu_start: float | None, started: float) -> float:
    """CPU seconds the worker spent since ``cpu_start``; wall seconds where there is no /proc. A
    worker gone meanwhile counts nothing more: the connection's EOF says that it died."""
    if cpu_start is None:
        return time.monotonic() - started
    now = _cpu_seconds(pid)
    return 0.0 if now is None else now - cpu_start


def _context():
    """multiprocessing's fork server, preloading xgrammar; started with a python interpreter (inside
    Triton's stub ``sys.executable`` may name the stub binary)."""
    context = multiprocessing.get_context("forkserver")
    if not os.path.basename(os.fsdecode(multiprocessing.spawn.get_executable() or "")).startswith("python"):
        context.set_executable(python_executable())
    context.set_forkserver_preload(_PRELOAD)
    return context


_fork_server_ended = threading.Event()


def fork_server_ended() -> bool:
    """Whether ``end_fork_server`` ran: this process is on its way out, and a worker's start that
    failed meanwhile is no fault to report."""
    return _fork_server_ended.is_set()


def end_fork_server() -> None:
    """Ends this process's fork server (SIGKILL, and its workers with it) and reaps it: for the engine
    core's exit, which must leave no process behind. Closing its pipe alone is not enough: one still
    importing its preload at its low priority notices the pipe's end only when the CPU lets it,
    seconds later on a busy machine."""
    from multiprocessing import forkserver  # noqa: PLC0415 (process: the module is in sys.modules only where a fork server started, core_process's test)

    _fork_server_ended.set()
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        server._stop()  # reaps it, closes its pipe and removes its socket
    except ChildProcessError:  # reaped already
        pass


def end_resource_tracker(timeout: float = 5.0) -> None:
    """Stops and reaps multiprocessing's resource tracker, which the fork server's start started and
    which outlives every process holding its pipe; after ``end_fork_server``, and only in a process
    whose sole multiprocessing children were the fork server's. Waits ``timeout`` seconds at most."""
    stopper = threading.Thread(target=resource_tracker._resource_tracker._stop, name="resource-tracker-stop",
                               daemon=True)
    stopper.start()
    stopper.join(timeout)


def lower_priority() -> None:
    """This process's nice value becomes at least ``NICE`` (a worker forked by the fork server, which
    already lowered its own, keeps NICE rather than going lower still)."""
    current = os.nice(0)
    if current < NICE:
        os.nice(NICE - current)


# ------------------------------------------------------------------------------------- the worker
def serve(connection, engine_pid: int) -> None:
    """The worker's body (run in the worker process): tokenizer info in, then compiles until EOF."""
    _die_with_parent(engine_pid)
    lower_priority()
    import torch  # noqa: PLC0415 (process: in the worker, at its low priority; xgrammar imports it: one thread)
    import xgrammar  # noqa: PLC0415 (optional: xgrammar, in the worker only)

    torch.set_num_threads(1)
    try:
        info_json = connection.recv_bytes().decode("utf-8")
    except (EOFError, ConnectionResetError):  # the engine stopped before this worker was ready
        return
    info = xgrammar.TokenizerInfo.deserialize_json(info_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    connection.send("ready")
    while True:
        try:
            spec = connection.recv()
        except (EOFError, ConnectionResetError):  # the engine closed the connection, or died
            return
        try:
            compiled = compiler.compile_grammar(to_grammar(spec))
        except Exception as exc:  # xgrammar raises RuntimeError and ValueError
            connection.send((xgrammar_message(exc), None))
            continue
        connection.send((None, _shipped(compiled)))


def _shipped(compiled) -> str | None:
    """The compiled grammar's JSON when it is small enough to be worth reading back; else None."""
    if compiled.memory_size_bytes > SHIP_BYTES:  # its text is about as large or larger: not worth writing
        return None
    text = compiled.serialize_json()
    return text if len(text) <= SHIP_BYTES else None


def _die_with_parent(engine_pid: int) -> None:
    """SIGKILL when the parent (the fork server) exits, which it does when the engine does; and
    exit now if the engine is already gone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the connection's EOF ends the worker
    try:
        os.kill(engine_pid, 0)
    except ProcessLookupError:
        os._exit(0)
