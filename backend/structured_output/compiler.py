"""Compiles constraints into xgrammar token-mask grammars off the engine step, with a cache.

The tokenizer's vocabulary is prepared once (``xgrammar.TokenizerInfo``, 0.15 s for SmolLM2's 49k
tokens, measured). Each distinct constraint compiles once on a small thread pool; requests carry
the ``Future`` and wait in the queue (not in the batch) until it resolves. The cache is an LRU of
futures keyed by ``StructuredOutputSpec.cache_key``, so a schema sent by a thousand requests, even
at the same moment, compiles once. Compile times and cache hits feed the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from backend.structured_output.spec import (
    StructuredOutputError,
    StructuredOutputSpec,
    to_grammar,
    xgrammar_message,
)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_COMPILE_THREADS = 1  # two cores here: one compiles while the other steps


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 threads: int = DEFAULT_COMPILE_THREADS, cache_entries: int = DEFAULT_CACHE_ENTRIES):
        """``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's."""
        import xgrammar  # noqa: PLC0415

        started = time.perf_counter()
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.num_compiles = 0  # constraints compiled (cache misses)
        self.num_cache_hits = 0  # requests whose constraint was compiled or compiling already
        self._compile_seconds: list[float] = []  # finished compiles not yet taken by the metrics
        logger.info("structured output: vocabulary of %d tokens prepared in %.2f s", vocab_size,
                    time.perf_counter() - started)

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
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutputSpec):
        started = time.perf_counter()
        try:
            compiled = self._compiler.compile_grammar(to_grammar(spec))
        except Exception as exc:
            raise StructuredOutputError(f"{spec.key}: does not compile: {xgrammar_message(exc)}") from None
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                self._compile_seconds.append(seconds)
        logger.debug("structured output: %s compiled in %.1f ms", spec.kind, seconds * 1e3)
        return compiled

    def take_compile_seconds(self) -> list[float]:
        """Compile times finished since the last call (for the compile-time histogram)."""
        with self._lock:
            taken, self._compile_seconds = self._compile_seconds, []
        return taken

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
