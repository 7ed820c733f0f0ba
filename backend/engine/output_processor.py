"""Everything after the forward, in one place: sample, verify proposals, append, stop, fan out, build outputs.

vLLM v1 splits this between ``Scheduler.update_from_output`` (every change to a request after the
forward) and its ``OutputProcessor`` (building outputs); nano-vllm's ``Scheduler.postprocess`` is
the same idea in a few lines. Here one class does both for a step's rows:

1. rows of requests that verify speculative proposals are set apart (``split_rows``);
2. samples 1..n-1 of an ``n > 1`` request fork from sample 0 at its first token, and enter the
   running set through ``Scheduler.add_forked``; beams keep their log-probabilities until their
   group's step, whose new beams fork the same way (backend/engine/beam_group.py);
3. grammar masks, then the sampler (row by row when the batch fails, so a bad row fails its
   request alone);
4. each request appends its token(s), detokenizes them and runs the stop checks; a verified run is
   appended token by token with the same checks, then the rejected positions' KV is rolled back
   (``Scheduler.rollback_speculation``, the one place that trims a request's KV);
5. finished requests leave the scheduler (their blocks are freed) and the request tables.

It also owns the tables of live requests (by engine id, ``n > 1`` groups and beam groups by the
client's id), since finishing, aborting and failing a request are where entries leave them.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from backend.engine.beam_group import BeamGroup
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.fanout import forked_request_id
from backend.engine.outputs import StepStats
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler import Scheduler
from backend.engine.sequence_group import SequenceGroup
from backend.engine.step_clock import PhaseClock
from backend.protocol.outputs import FinishReason, RequestOutput
from backend.runner.sampler import Sampler, SamplerOutput
from backend.runner.scheduled import ScheduledRequest

logger = logging.getLogger(__name__)


def internal_error_message(exc: BaseException) -> str:
    """What a client is told when generation failed on the server's side (the log has the traceback)."""
    return f"internal error during generation: {type(exc).__name__}: {exc}"


def split_rows(scheduled: list[ScheduledRequest], rows: list[int]
               ) -> tuple[list[int], list[int], list[tuple[ScheduledRequest, int, int]]]:
    """The runner's rows apart: (scheduled index of each one-row request, their row positions,
    [(scheduled item, first row, number of rows)] of requests verifying proposals)."""
    single, positions, verifying = [], [], []
    position = 0
    while position < len(rows):
        index, count = rows[position], 1
        while position + count < len(rows) and rows[position + count] == index:
            count += 1
        if scheduled[index].spec_token_ids:
            verifying.append((scheduled[index], position, count))
        else:
            single.append(index)
            positions.append(position)
        position += count
    return single, positions, verifying


def collect_prompt_logprobs(request: Request, first: int, values: list[float]) -> None:
    """Appends a chunk's prompt logprobs; positions already held (a preempted request recomputing) are skipped."""
    have = len(request.logprobs.prompt)
    if first <= have < first + len(values):
        request.logprobs.prompt.extend(values[have - first :])


def stop_reason(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Why ``request`` ends after appending ``token_id``; None when it goes on."""
    params = request.sampling_params
    if request.detokenizer.stop_matched is not None:
        return FinishReason.STOP
    if request.grammar is not None and request.grammar.terminated:
        return FinishReason.STOP  # the grammar accepted the EOS: the constrained output is complete
    if request.num_output_tokens >= params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return FinishReason.EOS
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def build_output(request: Request, new_token_ids: list[int], text: str) -> RequestOutput:
    """An unfinished output of ``request`` carrying ``new_token_ids`` (and their logprobs when asked)."""
    logprobs = ranks = top = None
    if request.sampling_params.logprobs and new_token_ids:
        logprobs = request.logprobs.output[-len(new_token_ids):]
        ranks = request.logprobs.output_ranks[-len(new_token_ids):]
        top = request.logprobs.output_top[-len(new_token_ids):]
    prompt_logprobs = None
    if request.sampling_params.prompt_logprobs is not None and not request.logprobs.prompt_sent and new_token_ids:
        prompt_logprobs, request.logprobs.prompt_sent = request.logprobs.prompt, True
    group = request.fanout.group
    return RequestOutput(  # by meaning: whose, what, how many, logprobs, when
        request_id=request.request_id if group is None else group.request_id,
        sequence_index=request.fanout.sequence_index,
        new_token_ids=new_token_ids, text=text, finished=False, finish_reason=None,
        num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        logprobs=logprobs, logprob_ranks=ranks, top_logprobs=top, prompt_logprobs=prompt_logprobs,
        arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
    )


class OutputProcessor:
    """Turns a step's logits into appended tokens and outputs; owns the tables of live requests."""

    def __init__(self, tokenizer, scheduler: Scheduler, sampler: Sampler, max_model_len: int,
                 speculator=None, structured_output=None) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.speculator = speculator  # backend.spec_decode.speculator.Speculator, or None
        self.structured_output = structured_output  # backend.structured_output.manager, or None
        self.requests: dict[str, Request] = {}  # every live engine request (samples and beams too)
        self.groups: dict[str, SequenceGroup] = {}  # requests with n > 1, by the client's id
        self.beam_groups: dict[str, BeamGroup] = {}  # beam-search requests, by the client's id

    def is_live(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups or request_id in self.beam_groups

    def register(self, request: Request) -> None:
        """A new request (already queued): its tables entry, and its group when it fans out."""
        params = request.sampling_params
        if params.beam_width > 1:
            request.fanout.beam = self.beam_groups[request.request_id] = BeamGroup.start(request, params)
        elif params.n > 1:
            request.fanout.group = self.groups[request.request_id] = SequenceGroup(request.request_id, params.n, [request])
        self.requests[request.request_id] = request

    # ----------------------------------------------------------------------------- the step's rows
    def process(self, scheduled: list[ScheduledRequest], logits: torch.Tensor, rows: list[int],
                stats: StepStats, clock: PhaseClock | None) -> list[RequestOutput]:
        """The outputs of one forward. logits: [len(rows), vocab_size]; ``rows[i]`` is the scheduled
        index whose row ``i`` is (a verifying request has one row per position it checks)."""
        outputs: list[RequestOutput] = []
        singles, positions, verifying = split_rows(scheduled, rows)
        spec_logits = logits
        if verifying:
            logits = logits.index_select(0, torch.tensor(positions, dtype=torch.int64, device=logits.device))
        if singles:
            self._sample_rows(logits, [scheduled[i].request for i in singles], outputs, stats, clock)
        if verifying:
            self._verify_rows(spec_logits, verifying, outputs, stats)
            if clock is not None:
                clock.lap(stats.timings, "verify")
        return outputs

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request], outputs: list[RequestOutput],
                     stats: StepStats, clock: PhaseClock | None) -> None:
        """One token for each row (forks, beams, grammars, the sampler), appended with the stop checks.
        logits: [len(requests), vocab_size]."""
        stats.num_sampled += len(requests)
        logits = self._fork_samples(logits, requests)
        if any(r.is_beam for r in requests):  # beams are scored, not sampled
            outputs.extend(self._beam_steps(logits, requests))
            keep = [i for i, r in enumerate(requests) if not r.is_beam]
            requests = [requests[i] for i in keep]
            logits = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
            if not requests:
                return
        if self.structured_output is not None and self.structured_output.apply_masks(logits, requests):
            if clock is not None:
                clock.lap(stats.timings, "grammar")  # only in steps with constrained requests
        sampled, errors = self._sample(logits, requests)
        if clock is not None:
            clock.lap(stats.timings, "sample")
        now = time.monotonic()
        for index, request in enumerate(requests):
            error = errors.get(index)
            if error is None:
                try:
                    outputs.append(self._append_sampled(request, sampled, index, now))
                    continue
                except Exception as exc:  # detokenizing or stop checks of this request alone
                    logger.exception("finishing the step of %s failed", request.request_id)
                    error = internal_error_message(exc)
            outputs.extend(self.fail([request.request_id], error))
        if clock is not None:
            clock.lap(stats.timings, "detokenize")

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[SamplerOutput, dict[int, str]]:
        """The sampler over all rows; if that fails, row by row, so a bad row fails its request alone.

        logits: [num_rows, vocab_size]. Returns the sampled rows and {row: error message}. The
        fallback keeps seeded outputs: the sampler draws its random numbers last, after every
        per-row check that can fail.
        """
        try:
            return self.sampler(logits, requests), {}
        except Exception:
            logger.exception("sampling the batch failed; sampling row by row")
        merged = SamplerOutput(token_ids=[0] * len(requests), logprobs=[0.0] * len(requests),
                               ranks=[0] * len(requests), top_logprobs=[[] for _ in requests])
        errors: dict[int, str] = {}
        for index, request in enumerate(requests):
            try:
                row = self.sampler(logits[index : index + 1], [request])
            except Exception as exc:
                logger.exception("sampling %s failed", request.request_id)
                errors[index] = internal_error_message(exc)
                continue
            merged.token_ids[index] = row.token_ids[0]
            if row.logprobs is not None:
                merged.logprobs[index] = row.logprobs[0]
                merged.ranks[index] = row.ranks[0]
                if row.top_logprobs is not None:
                    merged.top_logprobs[index] = row.top_logprobs[0]
        return merged, errors

    def _verify_rows(self, logits: torch.Tensor, verifying: list[tuple[ScheduledRequest, int, int]],
                     outputs: list[RequestOutput], stats: StepStats) -> None:
        """Requests that carried proposals: the verified run of tokens each (backend/spec_decode).
        logits: [all sampling rows, vocab_size]; verifying: (scheduled item, first row, rows)."""
        now = time.monotonic()
        for item, first, count in verifying:
            request = item.request
            try:
                tokens = self.speculator.verify(request, item.spec_token_ids, logits[first : first + count])
                outputs.append(self._append_tokens(request, tokens, now, verified=True))
                stats.num_sampled += 1
            except Exception as exc:  # this request alone
                logger.exception("verifying the proposals of %s failed", request.request_id)
                outputs.extend(self.fail([request.request_id], internal_error_message(exc)))

    # ----------------------------------------------------------------------------- appending tokens
    def _append_sampled(self, request: Request, sampled: SamplerOutput, index: int, now: float) -> RequestOutput:
        """Appends one sampled token (with its logprobs when asked) and applies the stop checks."""
        token_id = sampled.token_ids[index]
        if request.grammar is not None:
            self.structured_output.accept(request, token_id)  # raises (failing it alone) if refused
        if sampled.logprobs is not None and request.sampling_params.logprobs:
            request.logprobs.output.append(sampled.logprobs[index])
            request.logprobs.output_ranks.append(sampled.ranks[index])
            request.logprobs.output_top.append(sampled.top_logprobs[index] if sampled.top_logprobs else [])
        return self._append_tokens(request, [token_id], now)

    def _append_tokens(self, request: Request, tokens: list[int], now: float, verified: bool = False) -> RequestOutput:
        """Appends tokens one at a time, each with the stop checks, so a ``verified`` run of
        speculative tokens ends exactly where decoding without speculation would; a verified run
        that goes on rolls back the KV of the positions past what was kept (rejected proposals)."""
        if request.first_token_time is None:
            request.first_token_time = now
        text = ""
        for count, token_id in enumerate(tokens, start=1):
            request.append_output_token(token_id)
            text += request.detokenizer.update([token_id])
            reason = stop_reason(request, token_id, self.max_model_len)
            if reason is not None:
                status = RequestStatus.FINISHED_LENGTH if reason is FinishReason.LENGTH else RequestStatus.FINISHED_STOPPED
                self.scheduler.finish_request(request, status, reason)
                return self.final_output(request, tokens[:count], text)
        if verified:
            self.scheduler.rollback_speculation(request)
        return build_output(request, list(tokens), text)

    # ----------------------------------------------------------------------------- n > 1 fan-out
    def _fork_samples(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Samples 1..n-1 of each n > 1 request whose prompt this step completed fork from sample 0
        (its blocks shared, backend/engine/sequence_group.py) and join ``requests``, each with a copy
        of sample 0's logits row. logits: [num_rows, vocab_size]; returns [num_rows + forks, vocab_size]."""
        extra_rows: list[int] = []
        for row in range(len(requests)):
            parent = requests[row]
            group = parent.fanout.group
            if group is None or group.forked or parent.fanout.sequence_index != 0 or parent.num_output_tokens:
                continue
            group.forked = True
            params = parent.sampling_params
            for index in range(1, group.n):
                child_params = dataclasses.replace(
                    params, n=1, prompt_logprobs=None, seed=None if params.seed is None else (params.seed + index) % 2**64)
                child = parent.child(forked_request_id(group.request_id, "sample", index), child_params)
                child.fanout.group, child.fanout.sequence_index = group, index
                child.detokenizer = self._detokenizer(child)
                self.scheduler.add_forked(parent, child)
                self.requests[child.request_id] = child
                group.sequences.append(child)
                requests.append(child)
                extra_rows.append(row)
        if not extra_rows:
            return logits
        return torch.cat([logits, logits.index_select(0, torch.tensor(extra_rows, device=logits.device))])

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        params = request.sampling_params
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, stop=list(params.stop),
                                      skip_special_tokens=params.skip_special_tokens)

    # ----------------------------------------------------------------------------- beam search
    def _beam_steps(self, logits: torch.Tensor, requests: list[Request]) -> list[RequestOutput]:
        """Keeps each beam's log-probabilities; runs the step of every group whose beams are all
        in (backend/engine/beam_group.py). logits: [num_rows, vocab_size]."""
        touched: dict[str, BeamGroup] = {}
        for row, request in enumerate(requests):
            group = request.fanout.beam
            if group is None or group.finished:
                continue
            group.rows[group.beams.index(request)] = torch.log_softmax(logits[row].float(), dim=-1).cpu()
            touched[group.request_id] = group
        outputs: list[RequestOutput] = []
        for group in touched.values():
            if group.ready():
                outputs.extend(self._beam_step(group))
        return outputs

    def _beam_step(self, group: BeamGroup) -> list[RequestOutput]:
        decided = group.search.step(group.log_probs())
        group.rows.clear()
        if decided.done:
            return self.end_beam_search(group)
        old = group.beams
        new: list[Request] = []
        taken: set[int] = set()
        for parent_index in decided.parents:  # forks first: a parent takes its own token after
            parent = old[parent_index] if old[parent_index] is not None else old[0]  # not forked yet: beam 0's copy
            if parent_index not in taken and old[parent_index] is not None:
                taken.add(parent_index)
                new.append(parent)
                continue
            child = parent.child(forked_request_id(group.request_id, "beam", group.num_created),
                                 parent.sampling_params)
            group.num_created += 1
            child.fanout.beam = group
            self.scheduler.add_forked(parent, child)
            self.requests[child.request_id] = child
            new.append(child)
        for index, request in enumerate(old):
            if request is not None and index not in taken:  # no new beam continues it
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
                self.requests.pop(request.request_id, None)
        for request, token in zip(new, decided.tokens, strict=True):
            request.append_output_token(token)
        group.beams = new
        return []

    def end_beam_search(self, group: BeamGroup, aborted: bool = False) -> list[RequestOutput]:
        """Frees every running beam; the best n hypotheses (or one abort output) as the request's outputs."""
        group.finished = True
        self.beam_groups.pop(group.request_id, None)
        first = next(b for b in group.beams if b is not None)
        for request in group.beams:
            if request is None:
                continue
            if aborted:
                self.scheduler.abort_request(request)
            else:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
            self.requests.pop(request.request_id, None)
        base = dict(num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                    arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time)
        if aborted:
            return [RequestOutput(group.request_id, [], "", True, FinishReason.ABORT, num_output_tokens=0,
                                  sequence_finished=True, **base)]
        now = time.monotonic()
        params = first.sampling_params
        outputs = []
        hypotheses = group.search.best(group.n)
        for index, (tokens, _score) in enumerate(hypotheses):
            reason = FinishReason.EOS if tokens and tokens[-1] in group.search.eos_token_ids else FinishReason.LENGTH
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            outputs.append(RequestOutput(group.request_id, tokens, text, index == len(hypotheses) - 1, reason,
                                         num_output_tokens=len(tokens), sequence_index=index, sequence_finished=True,
                                         first_token_time=now, **base))
        return outputs

    # ----------------------------------------------------------------------------- endings
    def final_output(self, request: Request, new_token_ids: list[int], text: str) -> RequestOutput:
        """The request's last output: flushes held-back text and forgets the request."""
        if request.detokenizer is not None and request.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
            text += request.detokenizer.finish()
        self.requests.pop(request.request_id, None)  # and with it its detokenizer and generator
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        if request.grammar is not None:
            self.structured_output.release(request)
        output = build_output(request, new_token_ids, text)
        output.finished = output.sequence_finished = True
        output.finish_reason = request.finish_reason
        output.error = request.error
        output.kv_transfer_params = request.kv_transfer.params
        group = request.fanout.group
        if group is not None:  # the request ends with its last sample
            group.num_finished += 1
            output.finished = group.finished = group.num_finished == group.n
            if group.finished:
                self.groups.pop(group.request_id, None)
        return output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (frees its blocks); returns its final output, or None if unknown.

        Any sample of an n > 1 request (or the client's id) ends all of them, with one output."""
        request = self.requests.get(request_id)
        beam = self.beam_groups.get(request_id) or (request.fanout.beam if request is not None else None)
        if beam is not None:
            return self.end_beam_search(beam, aborted=True)[0] if not beam.finished else None
        group = self.groups.get(request_id) or (request.fanout.group if request is not None else None)
        if group is not None:
            return self._abort_group(group)
        if request is None:
            return None
        self.scheduler.abort_request(request)
        return self.final_output(request, [], "")

    def _abort_group(self, group: SequenceGroup) -> RequestOutput:
        first = group.sequences[0]
        for sequence in group.unfinished():
            self.scheduler.abort_request(sequence)
            self.requests.pop(sequence.request_id, None)
        group.finished = True
        self.groups.pop(group.request_id, None)
        output = build_output(first, [], "")
        output.finished = output.sequence_finished = True
        output.finish_reason = FinishReason.ABORT
        return output

    def fail(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        """Ends these requests with an error: each one's final output says ``message``."""
        outputs = []
        for request_id in request_ids:
            output = self.abort(request_id)
            if output is not None:
                output.finish_reason = FinishReason.ERROR
                output.error = message
                outputs.append(output)
        return outputs
