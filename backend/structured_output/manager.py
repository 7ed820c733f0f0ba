"""The engine's side of structured output: per request a grammar matcher, per step the token masks.

A constrained request gets a ``RequestGrammar`` when it is added: the future of its compiled grammar
(``compiler.py``). A constraint not compiled or compiling yet must first fit the budget
(``budget.py``) and its client must have a compile to spare (``client_limit.py``); else ``add``
raises and the request is refused at once. Until the future resolves the scheduler leaves the
request in the waiting queue and admits the ones behind it (``RequestGrammar.ready``); ``poll()`` at
the start of each step gives ready requests their ``xgrammar.GrammarMatcher`` and returns the ones
whose grammar failed, which the engine ends with the error. In the step, ``apply_masks`` fills one
bitmask row per constrained request (the tokens its grammar allows next; the EOS only where the
grammar may end) and sets every other logit of that row to -inf before sampling; the free rows are
left untouched, so a mixed batch gives free requests exactly their tokens alone. ``accept`` advances
a matcher on the sampled token; once it accepted a stop token the grammar is terminated and the
request finishes with ``stop``.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

import torch

from backend.attention.cpu_kernel.build import KernelUnavailable, load_kernel
from backend.config import StructuredOutputConfig
from backend.protocol.structured_output import StructuredOutputError, StructuredOutputSpec
from backend.structured_output.budget import check_budget
from backend.structured_output.client_limit import ClientCompileLimit
from backend.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

POLL_WAIT_SECONDS = 0.005  # an idle engine waiting only for grammars sleeps this long per step
_NOT_LOADED = object()


@dataclass(slots=True, eq=False)
class RequestGrammar:
    spec: StructuredOutputSpec
    future: concurrent.futures.Future
    matcher: object | None = None  # xgrammar.GrammarMatcher once the grammar compiled
    num_accepted: int = 0

    @property
    def ready(self) -> bool:
        """The scheduler may run the request (its grammar compiled)."""
        return self.matcher is not None

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the constrained output is complete."""
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, max_rows: int,
                 config: StructuredOutputConfig | None = None):
        import xgrammar  # noqa: PLC0415 (optional: xgrammar)

        self._xgrammar = xgrammar
        self.compiler = compiler
        self.config = config or StructuredOutputConfig()
        self.clients = ClientCompileLimit(self.config.structured_output_max_compiles_per_client)
        self.vocab_size = vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(max_rows, vocab_size)  # [max_rows, ceil(vocab/32)] int32
        self._pending: dict[str, object] = {}  # request id -> Request whose grammar is compiling
        self._cpu_kernel: object | None = _NOT_LOADED  # loaded on the first CPU step (a GPU never needs it)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_id: int | None, max_rows: int,
                      config: StructuredOutputConfig | None = None):
        """Starts the compile worker: raises CompileWorkerError when it cannot start."""
        config = config or StructuredOutputConfig()
        eos = [] if eos_token_id is None else [eos_token_id]
        compiler = GrammarCompiler(tokenizer, vocab_size, eos,
                                   timeout_seconds=config.structured_output_compile_timeout_seconds)
        return cls(compiler, vocab_size, max_rows, config)

    def close(self) -> None:
        """Kills the compile worker (idempotent, never waits long)."""
        self.compiler.close()

    def end_processes(self) -> None:
        """Kills the compile worker and waits until its processes are gone (a process about to exit)."""
        self.compiler.end_processes()

    # ----------------------------------------------------------------------------- requests
    def add(self, request) -> None:
        """Starts compiling the request's constraint (a cache hit resolves at once).

        A constraint not compiled or compiling yet raises StructuredOutputError naming its key and
        the parameter when it is over the budget or its client (``sampling_params.user``) has
        ``structured_output_max_compiles_per_client`` compiles in flight; a cache hit is never refused.
        """
        params = request.sampling_params
        spec = params.structured_outputs
        if self.compiler.is_cached(spec):
            future = self.compiler.compile(spec)
        else:
            check_budget(spec, self.config)
            self.clients.admit(params.user, spec.key)
            future = self.compiler.compile(spec)
            self.clients.track(params.user, future)
        request.grammar = RequestGrammar(spec, future)
        self._pending[request.request_id] = request

    def release(self, request) -> None:
        """The request ended (finished, aborted or failed)."""
        self._pending.pop(request.request_id, None)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def poll(self) -> list[tuple[object, str]]:
        """Gives requests whose grammar compiled their matcher; returns (request, error) of the failed."""
        failed = []
        for request_id, request in list(self._pending.items()):
            grammar = request.grammar
            if not grammar.future.done():
                continue
            del self._pending[request_id]
            try:
                compiled = grammar.future.result()
            except StructuredOutputError as exc:
                failed.append((request, str(exc)))
                continue
            except Exception as exc:  # cancelled at shutdown, or a compiler bug
                failed.append((request, f"{grammar.spec.key}: compiling failed ({type(exc).__name__}: {exc})"))
                continue
            grammar.matcher = self._xgrammar.GrammarMatcher(compiled)
        return failed

    def wait(self, timeout: float = POLL_WAIT_SECONDS) -> None:
        """Blocks until a pending grammar resolves or ``timeout`` passes (an engine with nothing else to do)."""
        futures = [request.grammar.future for request in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ----------------------------------------------------------------------------- the step
    def apply_masks(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
        requests: list,  # row i belongs to requests[i]
    ) -> int:
        """Sets the logits each constrained row's grammar forbids to -inf; returns how many rows."""
        rows = [i for i, request in enumerate(requests) if request.grammar is not None]
        if not rows:
            return 0
        bitmask = self._bitmask
        if bitmask.shape[0] < len(requests):
            bitmask = self._bitmask = self._xgrammar.allocate_token_bitmask(len(requests), self.vocab_size)
        for row in rows:
            requests[row].grammar.matcher.fill_next_token_bitmask(bitmask, row)
        if logits.device.type == "cpu" and self._cpu_kernel is _NOT_LOADED:
            self._cpu_kernel = _bitmask_kernel()
        if logits.device.type == "cpu" and self._cpu_kernel is not None and logits.dtype == torch.float32:
            apply_bitmask_cpu(self._cpu_kernel, logits, bitmask, rows, self.vocab_size)
        elif logits.device.type == "cpu":
            self._xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        else:
            device_mask = bitmask[: len(requests)].to(logits.device, non_blocking=True)
            self._xgrammar.apply_token_bitmask_inplace(logits, device_mask, vocab_size=self.vocab_size,
                                                       indices=rows, backend="torch_native")
        return len(rows)

    @staticmethod
    def accept(request, token_id: int) -> None:
        """Advances the request's matcher; raises StructuredOutputError if its grammar refuses the token
        (it cannot, since the token was sampled under the mask; a refusal is a bug, and fails only it)."""
        grammar = request.grammar
        if not grammar.matcher.accept_token(token_id):
            raise StructuredOutputError(
                f"{grammar.spec.key}: the grammar refused token {token_id} after {grammar.num_accepted} tokens")
        grammar.num_accepted += 1


def _bitmask_kernel():
    """Our CPU mask kernel (backend/attention/cpu_kernel/token_bitmask.cpp), 6x xgrammar's here; None:
    xgrammar's serves (the reason is logged)."""
    try:
        return load_kernel()
    except KernelUnavailable as exc:
        logger.warning("structured output masks use xgrammar's CPU kernel: %s", exc)
        return None


def apply_bitmask_cpu(
    kernels,
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, rows contiguous; modified in place
    bitmask: torch.Tensor,  # [>= num_rows, ceil(vocab_size / 32)] int32, xgrammar's layout
    rows: list[int],  # the rows to mask
    vocab_size: int,
) -> None:
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.is_contiguous()
    assert max(rows) < min(logits.shape[0], bitmask.shape[0]) and vocab_size <= min(logits.shape[1],
                                                                                     bitmask.shape[1] * 32)
    index = torch.tensor(rows, dtype=torch.int64)
    kernels.apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
                                index.data_ptr(), len(rows), vocab_size)
