"""Turns one step's logits into one token per request (vLLM v1 sampler semantics).

Processing order for each row (the same as vLLM v1):

1. ``min_tokens``: while ``request.num_output_tokens < min_tokens`` the row's
   ``stop_token_ids`` and its ``eos_token_id`` get ``-inf`` -- the EOS only when ``ignore_eos``
   is off (with ``ignore_eos`` EOS does not end the request, so masking it would only distort
   the distribution; this matches vLLM, whose stop-id set omits EOS under ``ignore_eos``).
   A row this would leave without any token (structured output allowing only the EOS) is not masked.
   Then ``logit_bias``: each listed token's bias is added to its raw logit (OpenAI's semantics;
   -100 all but bans a token, and a masked token stays masked).
2. Penalties on the raw logits: repetition penalty (HF semantics, over prompt + output tokens:
   a positive logit is divided by the penalty, a non-positive one multiplied), then frequency
   and presence penalties (OpenAI semantics, over output tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``).
3. Greedy rows (``temperature == 0``) take the argmax here; top-k/top-p/min-p do not apply.
4. Random rows: divide by temperature, then min-p (drop tokens whose probability is below
   ``min_p * max_prob``), then top-k (keep tokens whose logit is >= the k-th largest, so ties at
   the boundary are all kept), then top-p (keep the smallest most-likely set whose probability
   reaches ``top_p``, always at least one token; ties with its last token are kept), then sample.

Sampling uses the exponential race (equivalent to the Gumbel-max trick): the token is
``argmax(probs / q)`` with ``q = -log(U) ~ Exponential(1)`` i.i.d. over the vocabulary. Each step
draws exactly one vocab-sized ``U`` per row. A seeded request draws its ``q`` from its own
``torch.Generator`` (seeded from ``sampling_params.seed`` on first use, kept on the request), so
its tokens do not depend on the other rows or its row position; unseeded rows share the
sampler's engine generator.

Logprobs (``SamplerOutput.logprobs``) are those of the chosen token under the *final processed*
distribution: the log-softmax of the logits after steps 1-4 (masked tokens removed and the rest
renormalised, temperature applied). For greedy rows that is the log-softmax of the penalised
logits at temperature 1. With them come the chosen token's rank in that distribution (1 = most
likely; ties rank together) and, for requests with ``top_logprobs = k > 0``, its k most likely
tokens with their logprobs (vLLM's ``logprobs=k``).

For the engine: pass only rows whose sampled token will be kept (not partial prompt chunks),
since every call advances a seeded request's generator; ``min_tokens`` compares against
``request.num_output_tokens`` before this step's token is appended. A preempted request keeps
its generator (no token is sampled twice), so preemption does not change seeded outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backend.protocol.sampling import SamplingParams
from backend.runner.row_argmax import row_argmax
from backend.runner.scheduled import RunnerRequest


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row.

    ``logprobs`` is None unless some request in the batch asked for logprobs; then it has one
    entry per row (computed for every row, whether or not that row's request asked): the
    log-probability of the chosen token under the final processed distribution (see module doc).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None = None  # with logprobs: the chosen token's rank (1 = most likely)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with logprobs: k (token id, logprob) per row


def _has_penalties(sp: SamplingParams) -> bool:
    return sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0


def _min_tokens_stop_ids(request: RunnerRequest) -> list[int]:
    """Token ids to mask for this request this step ([] once min_tokens outputs exist)."""
    sp = request.sampling_params
    if request.num_output_tokens >= sp.min_tokens:
        return []
    ids = list(sp.stop_token_ids)
    if request.eos_token_id is not None and not sp.ignore_eos:
        ids.append(request.eos_token_id)
    return ids


class Sampler:
    """Samples one token per logits row; seeded requests carry their own generators.

    Not thread-safe: call it from the engine thread only.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed  # engine generator seed; None: nondeterministic
        self._generators_by_device: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------ generators

    def engine_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators_by_device.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators_by_device[device] = gen
        return gen

    def request_generator(self, request: RunnerRequest, device: torch.device) -> torch.Generator:
        """The seeded request's own generator, kept on the request (it goes when the request goes)."""
        if request.generator is None:
            request.generator = torch.Generator(device=device)
            request.generator.manual_seed(request.sampling_params.seed)
        return request.generator

    # ------------------------------------------------------------------ sampling

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size], any float dtype
        requests: list[RunnerRequest],
    ) -> SamplerOutput:
        """Samples one token for each row; row i belongs to ``requests[i]``."""
        num_rows = logits.shape[0]
        assert num_rows == len(requests), (num_rows, len(requests))
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=None)

        want_logprobs = False
        max_top = 0  # the most top logprobs any row wants
        plain_greedy = True  # greedy, no penalties, no active min_tokens mask
        for r in requests:
            sp = r.sampling_params
            want_logprobs |= sp.logprobs
            max_top = max(max_top, sp.top_logprobs if sp.logprobs else 0)
            if plain_greedy and (
                sp.temperature != 0.0 or _has_penalties(sp) or r.num_output_tokens < sp.min_tokens or sp.logit_bias
            ):
                plain_greedy = False

        if plain_greedy and not want_logprobs:
            # Hot path: one vectorised argmax, no copy of the logits.
            return SamplerOutput(token_ids=row_argmax(logits), logprobs=None)

        # float32 copy: we mask and scale in place; the caller's tensor stays untouched.
        logits = logits.to(dtype=torch.float32, copy=True)
        self._apply_min_tokens(logits, requests)
        self._apply_logit_bias(logits, requests)
        self._apply_penalties(logits, requests)

        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.temperature == 0.0]
        random_rows = [i for i, r in enumerate(requests) if r.sampling_params.temperature != 0.0]
        device = logits.device
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        chosen_logprobs = torch.empty(num_rows, dtype=torch.float32, device=device) if want_logprobs else None
        ranks = torch.empty(num_rows, dtype=torch.long, device=device) if want_logprobs else None
        top_values = torch.empty(num_rows, max_top, dtype=torch.float32, device=device) if max_top else None
        top_ids = torch.empty(num_rows, max_top, dtype=torch.long, device=device) if max_top else None

        if greedy_rows:
            g_logits, g_idx = _select_rows(logits, greedy_rows)  # [num_greedy, vocab]
            g_tokens = g_logits.argmax(dim=-1)  # [num_greedy]
            self._scatter(token_ids, g_idx, g_tokens)
            if chosen_logprobs is not None:
                self._logprob_details(g_logits, g_tokens, g_idx, max_top, chosen_logprobs, ranks, top_values, top_ids)

        if random_rows:
            r_logits, r_idx = _select_rows(logits, random_rows)  # [num_random, vocab]
            r_requests = [requests[i] for i in random_rows]
            r_logits = self.process_random(r_logits, r_requests)
            probs = torch.softmax(r_logits, dim=-1)  # [num_random, vocab]
            q = self._exponential(probs.shape, r_requests, device)  # [num_random, vocab]
            r_tokens = probs.div_(q).argmax(dim=-1)  # [num_random]
            self._scatter(token_ids, r_idx, r_tokens)
            if chosen_logprobs is not None:
                self._logprob_details(r_logits, r_tokens, r_idx, max_top, chosen_logprobs, ranks, top_values, top_ids)

        if chosen_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None)
        top_logprobs = None
        if max_top:
            value_rows, id_rows = top_values.tolist(), top_ids.tolist()
            top_logprobs = [
                list(zip(id_rows[i][: r.sampling_params.top_logprobs], value_rows[i][: r.sampling_params.top_logprobs],
                         strict=True)) if r.sampling_params.logprobs else []
                for i, r in enumerate(requests)
            ]
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=chosen_logprobs.tolist(),
                             ranks=ranks.tolist(), top_logprobs=top_logprobs)

    def _logprob_details(
        self,
        logits: torch.Tensor,  # [n, vocab_size] processed logits of these rows
        tokens: torch.Tensor,  # [n] the chosen tokens
        idx: torch.Tensor | None,  # [n] their rows in the batch, None: all rows
        max_top: int,
        chosen: torch.Tensor,  # [num_rows] out: chosen token logprobs
        ranks: torch.Tensor,  # [num_rows] out: chosen token ranks
        top_values: torch.Tensor | None,  # [num_rows, max_top] out; None when max_top is 0
        top_ids: torch.Tensor | None,  # [num_rows, max_top] out
    ) -> None:
        lp = chosen_logprobs(logits, tokens)  # [n]
        self._scatter(chosen, idx, lp)
        # Rank in logit order equals rank in logprob order (same row normaliser).
        chosen_logit = logits.gather(1, tokens[:, None])  # [n, 1]
        self._scatter(ranks, idx, (logits > chosen_logit).sum(dim=-1) + 1)
        if max_top:
            values, ids = logits.topk(max_top, dim=-1)  # [n, max_top]
            values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
            if idx is None:
                top_values.copy_(values)
                top_ids.copy_(ids)
            else:
                top_values[idx] = values
                top_ids[idx] = ids

    @staticmethod
    def _scatter(
        dst: torch.Tensor,  # [num_rows]
        idx: torch.Tensor | None,  # [n] row indices, None: all rows
        src: torch.Tensor,  # [n]
    ) -> None:
        if idx is None:
            dst.copy_(src)
        else:
            dst[idx] = src.to(dst.dtype)

    @staticmethod
    def _apply_logit_bias(
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
        requests: list[RunnerRequest],
    ) -> None:
        rows: list[int] = []
        cols: list[int] = []
        biases: list[float] = []
        for i, r in enumerate(requests):
            for token_id, bias in r.sampling_params.logit_bias.items():
                rows.append(i)
                cols.append(token_id)
                biases.append(bias)
        if rows:
            device = logits.device
            logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                              torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)

    @staticmethod
    def _apply_min_tokens(
        logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
        requests: list[RunnerRequest],
    ) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(requests):
            ids = _min_tokens_stop_ids(r)
            rows.extend([i] * len(ids))
            cols.extend(ids)
        if rows:
            device = logits.device
            row_index, col_index = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
            saved = logits[row_index, col_index]  # [num_masked]
            logits[row_index, col_index] = -math.inf
            # A row left with no token (a grammar that allows only the EOS now) keeps its EOS: the
            # constraint wins over min_tokens, since any other token would break it.
            masked_rows = torch.unique(row_index)
            empty = masked_rows[torch.isneginf(logits[masked_rows]).all(dim=-1)]
            if empty.numel():
                restore = torch.isin(row_index, empty)
                logits[row_index[restore], col_index[restore]] = saved[restore]

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
        requests: list[RunnerRequest],
    ) -> None:
        """Repetition, then frequency and presence penalties; O(tokens), not O(rows x vocab)."""
        device = logits.device

        rep_rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        if rep_rows:
            # HF RepetitionPenaltyLogitsProcessor over prompt + output tokens. A token seen twice
            # appears twice in (rows, cols); both writes store the same value, so it is
            # penalised once.
            rows, cols = _flat_token_index([requests[i].all_token_ids for i in rep_rows], rep_rows, device)
            penalty = torch.tensor(
                [requests[i].sampling_params.repetition_penalty for i in rep_rows],
                dtype=torch.float32,
                device=device,
            )
            per_token = penalty[_row_rank(rows, rep_rows, device)]  # [num_tokens]
            seen = logits[rows, cols]  # [num_tokens]
            logits[rows, cols] = torch.where(seen > 0, seen / per_token, seen * per_token)

        pf_rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling_params.presence_penalty != 0.0 or r.sampling_params.frequency_penalty != 0.0
        ]
        if pf_rows:
            # OpenAI frequency and presence penalties over output tokens only:
            # logit -= frequency * count + presence * (count > 0).
            rows, cols = _flat_token_index([requests[i].output_token_ids for i in pf_rows], pf_rows, device)
            if rows.numel() == 0:
                return
            rank = _row_rank(rows, pf_rows, device)
            freq = torch.tensor(
                [requests[i].sampling_params.frequency_penalty for i in pf_rows],
                dtype=torch.float32,
                device=device,
            )
            pres = torch.tensor(
                [requests[i].sampling_params.presence_penalty for i in pf_rows],
                dtype=torch.float32,
                device=device,
            )
            # Each occurrence subtracts the frequency penalty (accumulate adds duplicates up).
            logits.index_put_((rows, cols), -freq[rank], accumulate=True)
            # Each distinct (row, token) subtracts the presence penalty once.
            vocab_size = logits.shape[1]
            unique = torch.unique(rows * vocab_size + cols)
            u_rows = unique // vocab_size
            logits.index_put_(
                (u_rows, unique % vocab_size), -pres[_row_rank(u_rows, pf_rows, device)], accumulate=True
            )

    @staticmethod
    def process_random(
        logits: torch.Tensor,  # [num_random, vocab_size] float32, penalised; modified in place
        requests: list[RunnerRequest],
    ) -> torch.Tensor:  # [num_random, vocab_size], masked tokens at -inf
        """Temperature, min-p, top-k, top-p (vLLM v1 order)."""
        device = logits.device
        vocab_size = logits.shape[1]
        sps = [r.sampling_params for r in requests]

        temperature = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=device)
        logits = logits.div_(temperature[:, None])

        if any(sp.min_p > 0.0 for sp in sps):
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
            log_min_p = torch.tensor([sp.min_p for sp in sps], dtype=torch.float32, device=device).log()
            threshold = logits.amax(dim=-1) + log_min_p  # [num_random]
            logits.masked_fill_(logits < threshold[:, None], -math.inf)

        ks = [sp.top_k if 0 < sp.top_k < vocab_size else vocab_size for sp in sps]
        use_top_k = min(ks) < vocab_size
        use_top_p = any(sp.top_p < 1.0 for sp in sps)
        if not (use_top_k or use_top_p):
            return logits

        # A full sort of [rows, vocab] is slow on CPU; most rows decide within the top few
        # hundred tokens, so look there first and sort in full only the rows that need it.
        width = max(k for k in ks if k < vocab_size) if use_top_k else 0
        if use_top_p:
            width = max(width, _TOP_P_CANDIDATES)
        width = min(width, vocab_size)
        k = torch.tensor(ks, dtype=torch.long, device=device)  # [num_random]
        top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=device)
        values = logits.topk(width, dim=-1).values  # [num_random, width], descending
        threshold, resolved = _top_k_top_p_threshold(values, logits, k, top_p, use_top_p)
        if not bool(resolved.all()):
            rows = (~resolved).nonzero().squeeze(1)
            full = logits[rows].sort(dim=-1, descending=True).values  # [num_unresolved, vocab]
            threshold[rows], _ = _top_k_top_p_threshold(full, logits[rows], k[rows], top_p[rows], True)
        # Ties with the threshold are kept (for top-k as in vLLM, and the same for top-p).
        return logits.masked_fill_(logits < threshold[:, None], -math.inf)

    def _exponential(
        self,
        shape: torch.Size,  # (num_random, vocab_size)
        requests: list[RunnerRequest],
        device: torch.device,
    ) -> torch.Tensor:  # [num_random, vocab_size], i.i.d. Exponential(1), > 0
        """Exponential(1) noise as -log(U): several times faster than exponential_ on CPU."""
        u = torch.empty(shape, dtype=torch.float32, device=device)
        unseeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is None]
        if len(unseeded) == len(requests):
            u.uniform_(generator=self.engine_generator(device))
        else:
            if unseeded:
                draw = torch.empty(len(unseeded), shape[1], dtype=torch.float32, device=device)
                draw.uniform_(generator=self.engine_generator(device))
                u[torch.tensor(unseeded, device=device)] = draw
            for j, r in enumerate(requests):
                if r.sampling_params.seed is not None:
                    # One vocab-sized draw per step from the request's own stream: the result
                    # depends only on its seed and step, never on the batch around it.
                    u[j].uniform_(generator=self.request_generator(r, device))
        # U < 1 so q > 0. U == 0 would give q = inf and probs / q = 0 for an allowed token (a row
        # with one allowed token would then pick a masked one): clamp so q stays finite (<= 87.4).
        return u.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()


def _select_rows(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([len(rows), vocab_size], their indices; None: all rows)
    if len(rows) == logits.shape[0]:
        return logits, None
    index = torch.tensor(rows, device=logits.device)
    return logits[index], index


_TOP_P_CANDIDATES = 256  # tokens looked at before falling back to a full sort for top-p


def chosen_logprobs(
    logits: torch.Tensor,  # [n, vocab_size] processed logits
    token_ids: torch.Tensor,  # [n]
) -> torch.Tensor:  # [n] log_softmax(logits)[i, token_ids[i]], without the full log_softmax
    return logits.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _flat_token_index(
    token_lists: list[list[int]], rows: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens] row index, [num_tokens] token id)
    ids = [torch.tensor(t, dtype=torch.long) for t in token_lists]
    row_of = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.long), torch.tensor([len(t) for t in ids])
    )
    return row_of.to(device), torch.cat(ids).to(device)


def _row_rank(
    row_index: torch.Tensor,  # [n] absolute row numbers, each one of `rows`
    rows: list[int],  # sorted ascending
    device: torch.device,
) -> torch.Tensor:  # [n] position of each row number in `rows`
    return torch.searchsorted(torch.tensor(rows, dtype=torch.long, device=device), row_index)


def _top_k_top_p_threshold(
    values: torch.Tensor,  # [n, width] the largest logits of each row, descending
    logits: torch.Tensor,  # [n, vocab_size] the full rows (for the softmax normaliser)
    k: torch.Tensor,  # [n] top-k (vocab_size: off), at most width where on
    top_p: torch.Tensor,  # [n] (1.0: off)
    use_top_p: bool,  # some row has top_p < 1
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] smallest logit kept, [n] bool: decided by `values`)
    """Per-row logit threshold of top-k then top-p, from the row's `width` largest logits.

    A row is resolved when, if top-p is on, the tokens kept in `values` already hold at least
    `top_p` of the probability mass (so the top-p cut lies within `values`).
    """
    n, width = values.shape
    k_on = k < logits.shape[1]
    kth = values.gather(1, (k.clamp(max=width) - 1)[:, None]).squeeze(1)  # [n]
    kth = torch.where(k_on, kth, torch.full_like(kth, -math.inf))  # top-k off: keep all
    if not use_top_p:
        return kth, torch.ones(n, dtype=torch.bool, device=values.device)
    values = values.masked_fill(values < kth[:, None], -math.inf)
    # Softmax normaliser of the row after top-k; with top-k on, all kept tokens are in `values`.
    log_z = torch.logsumexp(values, dim=-1)  # [n]
    if not bool(k_on.all()):
        log_z = torch.where(k_on, log_z, torch.logsumexp(logits, dim=-1))
    probs = (values - log_z[:, None]).exp()  # [n, width]
    mass = probs.cumsum(dim=-1)
    # Keep a token while the more likely ones hold less than top_p; the first always stays.
    num_keep = ((mass - probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [n]
    p_threshold = values.gather(1, (num_keep - 1)[:, None]).squeeze(1)
    p_on = top_p < 1.0
    threshold = torch.where(p_on, torch.maximum(p_threshold, kth), kth)
    resolved = ~p_on | (mass[:, -1] >= top_p)
    return threshold, resolved
