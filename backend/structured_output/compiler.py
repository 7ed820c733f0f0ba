"""Compiles constraints into xgrammar token-mask grammars off the engine step, with a cache, under a timeout.

The tokenizer's vocabulary is prepared once (``xgrammar.TokenizerInfo``). Each distinct constraint
is compiled by the compile worker, a process of its own at a low CPU priority (compile_worker.py),
under ``timeout_seconds`` of its CPU time: one that runs past it is killed with its worker and fails
its requests with the timeout named, and a new worker takes the next compiles, so a hostile
constraint costs the engine core nothing. What the worker compiled in time comes back serialized
and is read back here on one thread, or, for a large grammar whose text would cost more than the
compile, is compiled again here (bounded work now: the worker just did it). Requests carry the
``Future`` and wait in the queue (not in the batch) until it resolves.

The cache is an LRU of futures keyed by ``StructuredOutputSpec.cache_key``, so a constraint sent by
a thousand requests, even at the same moment, compiles once. Failures stay cached, a timeout too
(it counts CPU time, so the same constraint would time out again; a client repeating it must not
tie up the worker each time). A compile interrupted for a reason that may not be the constraint's
(its worker died, or a busy machine left it no CPU) is forgotten: the next request for it compiles
again. Compile times and cache hits feed the metrics.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from backend.config import StructuredOutputConfig
from backend.protocol.structured_output import (
    StructuredOutputError,
    StructuredOutputSpec,
    to_grammar,
    xgrammar_message,
)
from backend.structured_output.compile_worker import (
    NICE,
    CompileInterrupted,
    CompileWorker,
    CompileWorkerError,
    end_fork_server,
    end_resource_tracker,
    fork_server_ended,
)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_TIMEOUT_SECONDS = StructuredOutputConfig().structured_output_compile_timeout_seconds


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, cache_entries: int = DEFAULT_CACHE_ENTRIES):
        """``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's.

        Starts the compile worker without waiting for it (its first start takes seconds that an
        engine start, and a model's recovery, should not wait for): the first compiles wait in its
        queue. A worker that cannot start is logged, and the constraints sent meanwhile fail with
        that said; every other request is served as usual."""
        import xgrammar  # noqa: PLC0415 (optional: xgrammar)

        started = time.perf_counter()
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self.timeout_seconds = timeout_seconds
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.num_compiles = 0  # constraints compiled (cache misses)
        self.num_cache_hits = 0  # requests whose constraint was compiled or compiling already
        self._runner = _Runner(self.tokenizer_info, timeout_seconds)
        self._close = weakref.finalize(self, self._runner.close)  # a compiler no one holds ends its worker
        self._runner.start()
        logger.info("structured output: vocabulary of %d tokens prepared in %.2f s; the compile worker is starting",
                    vocab_size, time.perf_counter() - started)

    def wait_started(self, timeout: float | None = None) -> bool:
        """Waits for the worker's first start (done or failed); True once it was attempted."""
        return self._runner.first_start.wait(timeout)

    @property
    def worker(self) -> CompileWorker:
        """The compile worker's handle (its ``pid`` is the process compiling now)."""
        return self._runner.worker

    def is_cached(self, spec: StructuredOutputSpec) -> bool:
        """The constraint is compiled or compiling (or failed and remembered): ``compile`` is a hit."""
        with self._lock:
            return spec.cache_key in self._cache

    def compile(self, spec: StructuredOutputSpec) -> Future:
        """A future of the spec's ``xgrammar.CompiledGrammar``; it fails with StructuredOutputError."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            self.num_compiles += 1
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(_forget_if_interrupted(self._cache, self._lock, key))
        self._runner.submit(spec, future)
        return future

    def take_compile_seconds(self) -> list[float]:
        """Compile times finished since the last call (for the compile-time histogram)."""
        return self._runner.take_seconds()

    def close(self) -> None:
        """Kills the worker and cancels the compiles not finished (idempotent, never waits long)."""
        self._close()

    def end_processes(self, timeout: float = 10.0) -> None:
        """``close``, then waits for the worker's processes to be gone, the fork server and its resource
        tracker included: for a process about to exit (the engine core). A later engine of this process
        would start the fork server again (its imports, seconds)."""
        self._close()
        self._runner.end_processes(timeout)


def _yield_to_steps() -> None:
    """The thread that reads back or compiles again runs at the worker's low priority (Linux keeps a
    nice value per thread), so the engine's step threads keep the CPU while it works."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


def _forget_if_interrupted(cache: OrderedDict, lock: threading.Lock, key: str):
    def forget(future: Future) -> None:
        if not future.cancelled() and isinstance(future.exception(), CompileInterrupted):
            with lock:
                if cache.get(key) is future:
                    del cache[key]

    return forget


class _Runner:
    """The worker and the two threads around it: ``grammar-compile-worker`` sends each constraint to
    the worker and waits for it under the timeout; ``grammar-compile`` reads back (or compiles again)
    what the worker compiled. It holds nothing of its GrammarCompiler, so that one can be collected."""

    def __init__(self, tokenizer_info, timeout_seconds: float):
        import xgrammar  # noqa: PLC0415 (optional: xgrammar)

        self._xgrammar = xgrammar
        self._tokenizer_info = tokenizer_info
        self.worker = CompileWorker(tokenizer_info.serialize_json())
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._timeout = timeout_seconds
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._here = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile", initializer=_yield_to_steps)
        self._closed = False
        self._seconds: list[float] = []  # finished compiles not yet taken by the metrics
        self._seconds_lock = threading.Lock()
        self._thread = threading.Thread(target=self._feed_worker, name="grammar-compile-worker", daemon=True)
        self.first_start = threading.Event()  # set once the first start was attempted

    def start(self) -> None:
        """The feeding thread starts the worker first, then takes the compiles (see GrammarCompiler)."""
        self._thread.start()

    def _start_first(self) -> None:
        if self._closed:
            self.first_start.set()
            return
        try:
            seconds = self.worker.start()
            logger.info("structured output: compile worker %d started in %.2f s", self.worker.pid, seconds)
        except CompileWorkerError:
            if self._closed or fork_server_ended():  # the engine stopped meanwhile, or its core is exiting
                logger.info("structured output: the compile worker's start was cut short by the engine's stop")
                return
            logger.exception("structured output: the grammar compile worker did not start; constrained requests "
                             "fail until it does (each new one tries again)")
        finally:
            self.first_start.set()

    def submit(self, spec: StructuredOutputSpec, future: Future) -> None:
        self._jobs.put((spec, future))

    def take_seconds(self) -> list[float]:
        with self._seconds_lock:
            taken, self._seconds = self._seconds, []
        return taken

    def close(self) -> None:
        """Never waits: the worker gets SIGKILL, the feeding thread reaps it and cancels what is queued."""
        self._closed = True
        self.worker.interrupt()
        self._jobs.put(None)
        self._here.shutdown(wait=False, cancel_futures=True)

    def end_processes(self, timeout: float) -> None:
        """After ``close``: ends the fork server until the feeding thread has ended (a worker start in
        flight, waiting for the fork server's preload, then fails at once; one that began just before
        ``close`` may have started a fork server since), then ends it for good with its resource tracker."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            end_fork_server()
            self._thread.join(0.05)
        end_fork_server()
        end_resource_tracker()

    # ------------------------------------------------------------------------------------ threads
    def _feed_worker(self) -> None:
        self._start_first()
        while (job := self._jobs.get()) is not None and not self._closed:
            spec, future = job
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                self._ensure_worker(spec)
                text = self.worker.compile(spec, self._timeout)
            except StructuredOutputError as exc:
                self._record(time.perf_counter() - started)
                future.set_exception(exc)
                if not self.worker.alive:  # killed for the timeout, or it died
                    self._restart()
                continue
            try:
                self._here.submit(self._finish, spec, future, text, time.perf_counter() - started)
            except RuntimeError:  # closed meanwhile
                future.cancel()
        self.worker.kill()
        if job is not None:
            job[1].cancel()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[1].cancel()

    def _finish(self, spec: StructuredOutputSpec, future: Future, text: str | None, worker_seconds: float) -> None:
        """The worker's compiled grammar read back, or (a large one) compiled again here."""
        started = time.perf_counter()
        try:
            if text is not None:
                compiled = self._xgrammar.CompiledGrammar.deserialize_json(text, self._tokenizer_info)
            else:
                compiled = self._compiler.compile_grammar(to_grammar(spec))
        except Exception as exc:  # the worker compiled it: not expected
            future.set_exception(StructuredOutputError(f"{spec.key}: does not compile: {xgrammar_message(exc)}"))
            return
        finally:
            seconds = time.perf_counter() - started
            self._record(worker_seconds + seconds)
        logger.debug("structured output: %s %s in %.1f ms here, %.1f ms in the worker", spec.kind,
                     "read back" if text is not None else "compiled again", seconds * 1e3, worker_seconds * 1e3)
        future.set_result(compiled)

    def _record(self, seconds: float) -> None:
        with self._seconds_lock:
            self._seconds.append(seconds)

    def _ensure_worker(self, spec: StructuredOutputSpec) -> None:
        if not self.worker.alive and not self._restart():
            raise CompileInterrupted(f"{spec.key}: the grammar compile worker could not be started "
                                    "(this process's log says why)")

    def _restart(self) -> bool:
        """A fresh worker for the next compiles; False (logged) when it does not start."""
        if self._closed:
            return False
        try:
            seconds = self.worker.start()
        except CompileWorkerError:
            logger.exception("structured output: restarting the grammar compile worker failed")
            return False
        if self._closed:  # close() came during the start and missed this worker
            self.worker.kill()
            return False
        logger.warning("structured output: grammar compile worker restarted (pid %d, %.2f s)", self.worker.pid,
                       seconds)
        return True
