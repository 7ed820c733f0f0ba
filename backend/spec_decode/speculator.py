"""One step of speculative decoding, as the engine drives it.

1. ``propose(running)`` before the schedule: requests that decode next (one known token to
   compute) and may speculate get proposals (prompt lookup, or the draft model's k rounds), as many
   as the controller's k for this step allows, in ``request.spec`` (backend/spec_decode/proposal.py). The scheduler fits
   them into the token budget and the pool (backend/engine/scheduler.py), else the request decodes as usual.
2. The model runner scores every position from the last known token on: 1 + k logits rows.
3. ``verify(request, rows)`` turns those rows into the tokens to append (backend/spec_decode/
   verification.py: exact for greedy and sampled requests); the engine appends them one by one with
   the usual stop checks and rolls the KV of rejected positions back.

What may speculate: decoding requests without penalties, logit_bias, logprobs, a grammar, beam search or an
active min_tokens mask (each changes the distribution token by token, which the k rows would have
to replay), with ``num_speculative_tokens`` not 0 in their sampling parameters. Proposals stop
short of max_tokens and max_model_len, so a step never appends past either.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from backend.config import EngineConfig
from backend.runner.row_argmax import row_argmax
from backend.runner.sampler import Sampler
from backend.runner.scheduled import ScheduledRequest
from backend.spec_decode.controller import SpeculationController, StepTimeModel
from backend.spec_decode.draft_model import DraftModelProposer
from backend.spec_decode.ngram import NgramProposer
from backend.spec_decode.proposal import SpeculatingRequest
from backend.spec_decode.verification import rejection_sample, verify_greedy, verify_seeded

logger = logging.getLogger(__name__)

CALIBRATION_CONTEXT = 128  # tokens before each calibration sequence's new ones
CALIBRATION_TOKENS_PER_SEQUENCE = 4  # a verifying request's 1 + k
CALIBRATION_REPEATS = 2


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counts (the llm_spec_decode_* metrics)."""

    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: proposal i accepted
    num_steps: int = 0  # steps with a request that could speculate
    num_speculated_steps: int = 0  # of those, steps the controller let speculate


class _FakeRequest:
    """What the model runner reads of a request, for timing steps at start-up."""

    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id = request_id
        self.all_token_ids = [1] * num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def time_runner_steps(runner, num_tokens: int, tokens_per_sequence: int) -> float:
    """Seconds of one forward of ``num_tokens`` new tokens in sequences of ``tokens_per_sequence``,
    each after CALIBRATION_CONTEXT cached tokens, best of CALIBRATION_REPEATS. The KV goes to the
    null block 0 (never handed out; its content only has to stay finite)."""
    scheduled, left, index = [], num_tokens, 0
    while left > 0:
        new = min(tokens_per_sequence, left)
        total = CALIBRATION_CONTEXT + new
        blocks = [0] * -(-total // runner.block_size)
        scheduled.append(ScheduledRequest(_FakeRequest(f"calibration-{index}", total), new, CALIBRATION_CONTEXT, blocks))
        left -= new
        index += 1
    best = float("inf")
    for _ in range(CALIBRATION_REPEATS):
        start = time.perf_counter()
        runner.execute(scheduled)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        best = min(best, time.perf_counter() - start)
    return best


class Speculator:
    """Proposer, controller and verification for one engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, runner, sampler: Sampler, max_model_len: int) -> None:
        spec = config.speculative
        self.method = spec.speculative_method
        self.max_k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if self.method == "ngram" else None
        self.draft = None
        if self.method == "draft":
            self.draft = DraftModelProposer(config, runner)
        step_time = proposal_time = None
        if spec.speculative_controller == "auto":
            started = time.perf_counter()
            time_runner_steps(runner, CALIBRATION_TOKENS_PER_SEQUENCE, CALIBRATION_TOKENS_PER_SEQUENCE)  # warm-up
            step_time = StepTimeModel.calibrate(
                lambda t: time_runner_steps(runner, t, CALIBRATION_TOKENS_PER_SEQUENCE))
            if self.draft is not None:
                draft_time = StepTimeModel.calibrate(lambda t: time_runner_steps(self.draft.runner, t, 1))
                # round 1 feeds about two tokens a request (the bonus and the last accepted), the others one
                proposal_time = lambda b, k: draft_time.predict(2 * b) + (k - 1) * draft_time.predict(b)  # noqa: E731
            logger.info("speculative decoding: step times measured in %.1f s: %s", time.perf_counter() - started,
                        ", ".join(f"{t} tokens {s * 1e3:.1f} ms" for t, s in zip(step_time.tokens, step_time.seconds, strict=True)))
        self.controller = SpeculationController(self.max_k, spec.speculative_controller, step_time, proposal_time,
                                                explores=self.draft is not None)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.max_k)
        self._shadows: dict[str, tuple[int, list[int]]] = {}  # prompt lookup checked without verifying

    # ----------------------------------------------------------------------------- eligibility
    def limit(self, request: SpeculatingRequest) -> int:
        """The most tokens ``request`` may propose now (0: it decodes as usual)."""
        params = request.sampling_params
        if (not request.is_running or request.num_computed_tokens != request.num_tokens - 1
                or params.num_speculative_tokens == 0 or request.is_beam or request.grammar is not None
                or params.logprobs or params.logit_bias or request.num_output_tokens < params.min_tokens
                or params.repetition_penalty != 1.0
                or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
            return 0
        k = self.max_k if params.num_speculative_tokens is None else min(self.max_k, params.num_speculative_tokens)
        # the step appends up to k + 1 tokens: never past max_tokens or max_model_len
        return max(0, min(k, params.max_tokens - request.num_output_tokens - 1,
                          self.max_model_len - request.num_tokens - 1))

    # ----------------------------------------------------------------------------- proposing
    def propose(self, running: list[SpeculatingRequest]) -> None:
        """Sets ``spec`` of every running request for this step (no tokens where none)."""
        self.clear(running)
        ids = {r.request_id for r in running}
        self._check_shadows(running)
        limits = {r.request_id: self.limit(r) for r in running}
        candidates = [r for r in running if limits[r.request_id] > 0]
        if self.ngram is not None:
            self.ngram.keep_only(ids)
        if self.draft is not None:
            self.draft.keep_only(ids)
        if not candidates:
            return
        other_tokens = sum(max(0, r.num_tokens - r.num_computed_tokens) for r in running if limits[r.request_id] == 0)
        other_decodes = sum(1 for r in running if limits[r.request_id] == 0 and r.num_computed_tokens == r.num_tokens - 1)
        if self.ngram is not None:
            found = {r.request_id: self.ngram.propose(r, limits[r.request_id]) for r in candidates}
            proposing = [r for r in candidates if found[r.request_id]]
            other_tokens += len(candidates) - len(proposing)
            other_decodes += len(candidates) - len(proposing)
            if not proposing:
                return
            k = self.controller.choose([len(found[r.request_id]) for r in proposing], other_tokens, other_decodes)
            for request in proposing:
                proposal = found[request.request_id]
                if k:
                    request.spec.token_ids = proposal[:k]
                elif request.request_id not in self._shadows:
                    self._shadows[request.request_id] = (request.num_tokens, proposal)
            return
        k = self.controller.choose([limits[r.request_id] for r in candidates], other_tokens, other_decodes)
        if not k:
            return
        if self.controller.exploring:  # a try: the one request the draft is closest to (the least to catch up)
            candidates = [min(candidates, key=self.draft.lag)]
        proposals = self.draft.propose(candidates, min(k, max(limits[r.request_id] for r in candidates)))
        for request in candidates:
            entry = proposals.get(request.request_id)
            if entry is None:
                continue
            tokens, probs = entry
            n = min(len(tokens), limits[request.request_id])
            request.spec.token_ids = tokens[:n]
            request.spec.draft_probs = probs[:n] if probs is not None else None

    @staticmethod
    def clear(requests: list[SpeculatingRequest]) -> None:
        """No proposals for ``requests`` this step (before proposing, or after a proposer failed)."""
        for request in requests:
            request.spec.clear()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if self.controller.step_time is not None and num_tokens > 0:
            self.controller.step_time.observe(num_tokens, seconds)

    def _check_shadows(self, running: list[SpeculatingRequest]) -> None:
        """Prompt-lookup proposals the controller did not verify, checked against what came instead."""
        if not self._shadows:
            return
        by_id = {r.request_id: r for r in running}
        for request_id in list(self._shadows):
            request = by_id.get(request_id)
            start, proposal = self._shadows[request_id]
            if request is None:
                del self._shadows[request_id]
                continue
            if request.num_tokens < start + len(proposal):
                continue
            produced = request.all_token_ids[start : start + len(proposal)]
            matched = 0
            while matched < len(proposal) and produced[matched] == proposal[matched]:
                matched += 1
            self.controller.acceptance.observe(len(proposal), matched)
            del self._shadows[request_id]

    # ----------------------------------------------------------------------------- verifying
    def verify(self, request: SpeculatingRequest, proposals: list[int], rows: torch.Tensor) -> list[int]:
        """The tokens to append after the target scored ``proposals``. rows: [1 + k, vocab] logits."""
        if request.sampling_params.greedy:
            tokens = verify_greedy(row_argmax(rows), proposals)
            accepted = len(tokens) - 1
        else:
            repeated = [request] * rows.shape[0]
            probs = torch.softmax(Sampler.process_random(rows.float().clone(), repeated), dim=-1)
            if request.sampling_params.seed is not None:  # the same tokens as without speculation
                tokens, accepted = verify_seeded(probs, proposals, self.sampler.request_generator(request, rows.device))
            else:
                draft_probs = request.spec.draft_probs
                if draft_probs is not None:
                    draft_probs = draft_probs[: len(proposals)].to(probs.device)
                tokens, accepted = rejection_sample(probs, proposals, draft_probs,
                                                    self.sampler.engine_generator(rows.device))
        self._count(len(proposals), accepted)
        return tokens

    def _count(self, num_proposed: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_position[i] += 1
        self.controller.acceptance.observe(num_proposed, num_accepted)

    def release(self, request_id: str) -> None:
        """The request ended: its proposer state and draft KV go."""
        self._shadows.pop(request_id, None)
        if self.ngram is not None:
            self.ngram.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)

    def snapshot(self) -> SpecDecodeStats:
        stats = self.stats
        stats.num_steps, stats.num_speculated_steps = self.controller.num_steps, self.controller.num_speculated_steps
        return SpecDecodeStats(stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position),
                               stats.num_steps, stats.num_speculated_steps)
