"""Proposals from a draft model: a small checkpoint with the target's vocabulary, run k times per
step on its own paged KV cache (with its own prefix cache) inside the engine's step.

Each proposing request has a ``ShadowSequence`` here that shares the target request's token list,
so the draft's KV manager sees the very tokens the target keeps; the draft's KV covers a prefix
of them (``num_computed_tokens``). Round 1 feeds the tokens the draft has not seen yet (the
whole prompt the first time, then usually the last one or two tokens) and samples proposal 1;
round r feeds proposal r - 1 as a speculative token (backend/runner/model_runner.py reads
``spec_token_ids``) and samples proposal r. All proposing requests run together in each round.
Proposals are greedy (the draft's argmax) for greedy requests and drawn from the draft's processed
distribution (the request's temperature, top-k, top-p, min-p) for sampled ones, which keeps those
distributions for rejection sampling.

After the target verified them, only the draft KV of accepted proposals stays valid: the next
call compares what it proposed with what the target appended (``_sync``) and rolls its KV back to
the common prefix (blocks past it are freed; none of them were hashed).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from backend.config import CacheConfig, ConfigError, EngineConfig
from backend.kv_cache.manager import KVCacheManager
from backend.kv_cache.request_view import RequestBlocks
from backend.protocol.sampling import SamplingParams
from backend.runner.model_runner import ModelRunner
from backend.runner.row_argmax import row_argmax
from backend.runner.sampler import Sampler
from backend.runner.scheduled import ScheduledRequest
from backend.sequence_view import TokenCounts
from backend.spec_decode.proposal import SpeculatingRequest
from backend.spec_decode.verification import race

logger = logging.getLogger(__name__)

DRAFT_SEED_OFFSET = 0x5DEECE66D  # a seeded request's draft generator: seed + this (its own stream)


@dataclasses.dataclass(slots=True, eq=False)
class ShadowSequence(TokenCounts):
    """A target request as the draft's runner and KV manager see it: the same token list, the
    draft's own progress and block record (backend/runner/scheduled.py, backend/kv_cache/request_view.py)."""

    request_id: str
    all_token_ids: list[int]  # the target request's own list: the draft sees every new token
    num_computed_tokens: int = 0  # tokens whose draft KV is in the draft's cache
    # never sampled by the runner (the proposer draws its tokens): the parameters only fill the view
    sampling_params: SamplingParams = dataclasses.field(default_factory=lambda: SamplingParams(max_tokens=1))
    eos_token_id: int | None = None
    generator: torch.Generator | None = None
    kv: RequestBlocks = dataclasses.field(default_factory=RequestBlocks)
    prompt_token_ids: tuple[int, ...] = ()  # the whole list is "output": nothing is the draft's prompt
    is_finished: bool = False  # its blocks are freed without a transfer, whatever the target did


@dataclasses.dataclass(slots=True)
class DraftSequence:
    shadow: ShadowSequence
    proposed_at: int = 0  # num_tokens when the last proposals were made
    proposed: list[int] = dataclasses.field(default_factory=list)
    generator: torch.Generator | None = None


class DraftModelProposer:
    """Runs the draft model for the proposing requests of a step."""

    def __init__(self, config: EngineConfig, target: ModelRunner, runner: ModelRunner | None = None) -> None:
        spec = config.speculative
        if runner is None:
            model = dataclasses.replace(config.model, model_dir=spec.speculative_model_dir,
                                        tokenizer_dir=spec.speculative_model_dir,
                                        dtype=_dtype_name(target.dtype), device=target.device.type,
                                        tensor_parallel_size=1)  # the draft runs whole, on rank 0
            num_blocks = spec.speculative_num_kv_blocks or target.num_kv_blocks
            cache = CacheConfig(block_size=target.block_size, num_kv_blocks=num_blocks)
            try:
                runner = ModelRunner.load(model, cache, config.scheduler.max_num_seqs)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("'model_dir'", "'speculative_model_dir'")) from None
        if runner.vocab_size != target.vocab_size:
            raise ConfigError(f"parameter 'speculative_model_dir': the draft's vocabulary has {runner.vocab_size} "
                              f"tokens, the target's {target.vocab_size}; they must be the same")
        self.runner = runner
        self.block_size = runner.block_size
        self.kv = KVCacheManager(runner.num_kv_blocks, runner.block_size, enable_caching=True,
                                 sliding_window=runner.model.family.shared_window)
        self.sequences: dict[str, DraftSequence] = {}
        self._generator = torch.Generator(device=runner.device)
        self._generator.manual_seed(config.model.seed + DRAFT_SEED_OFFSET)
        self.num_forwards = 0

    # ----------------------------------------------------------------------------- bookkeeping
    def release(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence.shadow)

    def keep_only(self, request_ids) -> None:
        for request_id in [r for r in self.sequences if r not in request_ids]:
            self.release(request_id)

    def lag(self, request: SpeculatingRequest) -> int:
        """Tokens of ``request`` the draft has not computed (its whole history when it has none)."""
        sequence = self.sequences.get(request.request_id)
        return request.num_tokens - (sequence.shadow.num_computed_tokens if sequence is not None else 0)

    @property
    def usage(self) -> float:
        return self.kv.usage

    def _sequence(self, request: SpeculatingRequest) -> DraftSequence:
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            shadow = ShadowSequence(request.request_id, request.all_token_ids)
            sequence = self.sequences[request.request_id] = DraftSequence(shadow)
            if request.sampling_params.seed is not None:
                sequence.generator = torch.Generator(device=self.runner.device)
                sequence.generator.manual_seed((request.sampling_params.seed + DRAFT_SEED_OFFSET) % 2**64)
        self._sync(sequence)
        return sequence

    def _sync(self, sequence: DraftSequence) -> None:
        """Rolls the draft's KV back to the tokens it shares with the target: its KV past the known
        tokens holds proposals, valid only where the target appended those same tokens."""
        shadow = sequence.shadow
        tokens = shadow.all_token_ids
        valid = min(shadow.num_computed_tokens, len(tokens) - 1)  # the last known token is fed again
        start = sequence.proposed_at
        if shadow.num_computed_tokens > start:
            agree = 0
            for offset, proposed in enumerate(sequence.proposed):
                if start + offset >= len(tokens) or tokens[start + offset] != proposed:
                    break
                agree += 1
            valid = min(valid, start + agree)
        if valid < shadow.num_computed_tokens:
            shadow.num_computed_tokens = valid
            self.kv.trim(shadow, valid)
        sequence.proposed = []

    # ----------------------------------------------------------------------------- proposing
    @torch.inference_mode()
    def propose(self, requests: list[SpeculatingRequest], k: int) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """{request id: (up to k proposals, their draft distributions [n, vocab] or None when greedy)}."""
        active = []
        for request in requests:
            sequence = self._sequence(request)
            shadow = sequence.shadow
            if shadow.num_computed_tokens == 0 and not self.kv.req_to_blocks.get(shadow.request_id):
                blocks, hit = self.kv.get_computed_blocks(shadow)
            else:
                blocks, hit = [], 0
            num_new = len(shadow.all_token_ids) - shadow.num_computed_tokens - hit
            if self.kv.allocate_slots(shadow, num_new, blocks) is None:
                continue  # the draft pool is full: this request does not speculate this step
            shadow.num_computed_tokens += hit
            sequence.proposed_at = len(shadow.all_token_ids)
            active.append((request, sequence, num_new))
        results: dict[str, tuple[list[int], list[torch.Tensor] | None]] = {}
        for round_index in range(k):
            if not active:
                break
            scheduled = []
            for _request, sequence, num_new in active:
                shadow = sequence.shadow
                scheduled.append(ScheduledRequest(shadow, num_new, shadow.num_computed_tokens,
                                                  self.kv.get_block_ids(shadow.request_id), list(sequence.proposed)))
            logits, rows = self.runner.execute(scheduled)  # one row per request, in the runner's order
            self.num_forwards += 1
            tokens, probs = self._choose(logits, [active[i][0] for i in rows], [active[i][1] for i in rows])
            still = []
            for row, index in enumerate(rows):
                request, sequence, num_new = active[index]
                token, prob = tokens[row], probs[row]
                sequence.shadow.num_computed_tokens += num_new
                sequence.proposed.append(token)
                entry = results.setdefault(request.request_id, ([], [] if prob is not None else None))
                entry[0].append(token)
                if prob is not None:
                    entry[1].append(prob)
                if round_index + 1 < k and self.kv.allocate_slots(sequence.shadow, 1) is not None:
                    still.append((request, sequence, 1))
            active = still
        return {rid: (tokens, torch.stack(probs) if probs is not None else None)
                for rid, (tokens, probs) in results.items()}

    def _choose(self, logits: torch.Tensor, requests: list[SpeculatingRequest],
                sequences: list[DraftSequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy rows: the argmax. Sampled rows: a draw from the processed draft distribution."""
        tokens = row_argmax(logits)
        probs: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:
            rows = logits.index_select(0, torch.tensor(sampled, device=logits.device)).float()
            processed = Sampler.process_random(rows, [requests[i] for i in sampled])
            dist = torch.softmax(processed, dim=-1)  # [num_sampled, vocab]
            for j, i in enumerate(sampled):
                tokens[i] = race(dist[j], sequences[i].generator or self._generator)
                probs[i] = dist[j]
        return tokens, probs


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
