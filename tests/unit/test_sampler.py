"""Sampler: greedy, per-request seeds, top-k/top-p/min-p statistics, penalties, min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from backend.engine.request import Request
from backend.protocol.sampling import SamplingParams
from backend.runner.sampler import Sampler, SamplerOutput

VOCAB = 64


def make_request(
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos_token_id: int | None = None,
    **params,
) -> Request:
    req = Request(request_id, list(prompt or [1, 2, 3]), SamplingParams(**params), eos_token_id=eos_token_id)
    for t in output or []:
        req.append_output_token(t)
    return req


def random_logits(num_rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * 3  # [num_rows, vocab]


# ---------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_fast_path() -> None:
    logits = random_logits(16, seed=0)
    before = logits.clone()
    out = Sampler()(logits, [make_request(f"r{i}") for i in range(16)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_greedy_logprobs_and_mixed_batch() -> None:
    logits = random_logits(6, seed=1)
    before = logits.clone()
    reqs = [
        make_request(f"r{i}", logprobs=(i == 0), temperature=(0.0 if i % 2 == 0 else 1.0), seed=i)
        for i in range(6)
    ]
    out = Sampler()(logits, reqs)
    assert torch.equal(logits, before)
    want_lp = torch.log_softmax(logits, -1)
    for i in (0, 2, 4):  # greedy rows
        assert out.token_ids[i] == int(logits[i].argmax())
        assert out.logprobs[i] == pytest.approx(float(want_lp[i].max()), abs=1e-6)
    for i in (1, 3, 5):  # temperature 1, no filters: the processed distribution is the raw one
        assert out.logprobs[i] == pytest.approx(float(want_lp[i, out.token_ids[i]]), abs=1e-6)


def test_ranks_and_top_logprobs_follow_the_processed_distribution() -> None:
    logits = random_logits(4, seed=7)
    reqs = [
        make_request("greedy-top3", logprobs=True, top_logprobs=3),
        make_request("random-top5", logprobs=True, top_logprobs=5, temperature=0.7, seed=3),
        make_request("rank-only", logprobs=True, temperature=1.0, seed=4),
        make_request("no-logprobs"),
    ]
    out = Sampler()(logits, reqs)
    for i, temperature in ((0, 1.0), (1, 0.7), (2, 1.0)):
        want = torch.log_softmax(logits[i] / temperature, -1)
        chosen = out.token_ids[i]
        assert out.ranks[i] == int((want > want[chosen]).sum()) + 1
        k = reqs[i].sampling_params.top_logprobs
        values, ids = want.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.ranks[0] == 1 and out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy: the best token
    assert out.top_logprobs[3] == []


def test_bfloat16_logits() -> None:
    logits = random_logits(4, seed=2).to(torch.bfloat16)
    out = Sampler()(logits, [make_request(f"r{i}", logprobs=True) for i in range(4)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert len(out.logprobs) == 4


# ---------------------------------------------------------------------- seeds


def _run_seeded(row: int, num_rows: int, steps: int, seed: int = 1234) -> list[int]:
    """Samples `steps` tokens for a seeded request placed at `row` among varied neighbours."""
    sampler = Sampler(seed=99)
    target = make_request("target", temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    neighbours = [
        make_request(f"n{num_rows}-{i}", temperature=1.0 + 0.1 * i, seed=(None if i % 2 else 1000 + i))
        if i % 3
        else make_request(f"n{num_rows}-{i}")
        for i in range(num_rows - 1)
    ]
    target_logits = random_logits(steps, seed=7)  # [steps, vocab]
    tokens = []
    for step in range(steps):
        logits = random_logits(num_rows, seed=100 + step * 31 + num_rows)
        logits[row] = target_logits[step]
        reqs = neighbours[:row] + [target] + neighbours[row:]
        tokens.append(sampler(logits, reqs).token_ids[row])
    return tokens


def test_seeded_request_independent_of_batch_and_row() -> None:
    alone = _run_seeded(row=0, num_rows=1, steps=30)
    assert _run_seeded(row=0, num_rows=8, steps=30) == alone
    assert _run_seeded(row=5, num_rows=8, steps=30) == alone
    assert _run_seeded(row=2, num_rows=3, steps=30) == alone
    assert len(set(alone)) > 3  # it really samples


def test_different_seeds_differ_and_a_new_request_restarts_its_stream() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is informative

    def draw(sampler: Sampler, request: Request, steps: int = 10) -> list[int]:
        return [sampler(logits, [request]).token_ids[0] for _ in range(steps)]

    sampler = Sampler()
    first = make_request("s", temperature=1.0, seed=1)
    a = draw(sampler, first)
    b = draw(sampler, make_request("s", temperature=1.0, seed=2))
    assert a != b
    assert draw(sampler, make_request("s", temperature=1.0, seed=1)) == a  # a new request: the stream restarts
    assert draw(sampler, first) != a  # the same request: its stream continues


def test_engine_seed_makes_unseeded_requests_reproducible() -> None:
    logits = random_logits(8, seed=3)
    reqs = [make_request(f"u{i}", temperature=1.0) for i in range(8)]
    assert Sampler(seed=5)(logits, reqs).token_ids == Sampler(seed=5)(logits, reqs).token_ids


# ---------------------------------------------------------------------- filters, statistically

BASE = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
NUM_DRAWS = 20_000


def _frequencies(**params) -> tuple[torch.Tensor, list[float]]:
    reqs = [make_request(f"d{i}", **params, logprobs=True) for i in range(NUM_DRAWS)]
    out = Sampler(seed=0)(BASE.repeat(NUM_DRAWS, 1), reqs)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(BASE)).double()
    return counts / NUM_DRAWS, out.logprobs


def _check(freq: torch.Tensor, logprobs: list[float], allowed: list[int], temperature: float) -> None:
    probs = torch.softmax(BASE.double() / temperature, -1)
    want = torch.zeros_like(probs)
    want[allowed] = probs[allowed] / probs[allowed].sum()
    outside = [i for i in range(len(BASE)) if i not in allowed]
    assert freq[outside].sum() == 0, freq
    # 5 standard deviations of a binomial frequency
    tol = 5 * torch.sqrt(want * (1 - want) / NUM_DRAWS) + 1e-3
    assert torch.all((freq - want).abs() <= tol), (freq, want)
    # logprobs are those of the renormalised (processed) distribution
    assert {round(lp, 4) for lp in logprobs} <= {round(math.log(want[i]), 4) for i in allowed}


def test_temperature_only() -> None:
    freq, lp = _frequencies(temperature=0.7)
    _check(freq, lp, list(range(10)), 0.7)


def test_top_k() -> None:
    freq, lp = _frequencies(temperature=1.0, top_k=3)
    _check(freq, lp, [0, 1, 2], 1.0)


def test_top_p() -> None:
    probs = torch.softmax(BASE, -1)  # [0.333, 0.223, 0.150, ...]: cumsum .333 .556 .706
    assert probs[:2].sum() < 0.6 < probs[:3].sum()
    freq, lp = _frequencies(temperature=1.0, top_p=0.6)  # needs 3 tokens to reach 0.6
    _check(freq, lp, [0, 1, 2], 1.0)


def test_min_p() -> None:
    # keep p >= 0.3 * p_max  <=>  logit >= 2.0 + log(0.3) = 0.796
    freq, lp = _frequencies(temperature=1.0, min_p=0.3)
    _check(freq, lp, [0, 1, 2, 3], 1.0)


def test_top_k_and_top_p_with_temperature() -> None:
    # temperature 2 flattens; top 5 renormalised are [.280, .230, .188, ...]; top_p=0.6 of them
    probs = torch.softmax(BASE / 2, -1)[:5]
    probs = probs / probs.sum()
    assert probs[:2].sum() < 0.6 < probs[:3].sum()
    freq, lp = _frequencies(temperature=2.0, top_k=5, top_p=0.6)
    _check(freq, lp, [0, 1, 2], 2.0)


def test_mixed_filters_in_one_batch() -> None:
    """Rows with different filters do not leak into each other."""
    params = [dict(temperature=1.0, top_k=2), dict(temperature=1.0, top_p=0.4), dict(temperature=1.0)]
    reqs = [make_request(f"m{i}", **params[i % 3]) for i in range(3000)]
    out = Sampler(seed=1)(BASE.repeat(3000, 1), reqs).token_ids
    assert set(out[0::3]) == {0, 1}
    assert set(out[1::3]) == {0, 1}  # 0.333 < 0.4 <= 0.556
    assert len(set(out[2::3])) >= 7


def _reference_kept(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:  # [vocab] bool
    """Straightforward float64 full-sort top-k/top-p/min-p, one row at a time."""
    x = row.double() / sp.temperature
    if sp.min_p > 0:
        p = torch.softmax(x, -1)
        x[p < sp.min_p * p.max()] = -math.inf
    if 0 < sp.top_k < len(x):
        x[x < x.sort(descending=True).values[sp.top_k - 1]] = -math.inf
    if sp.top_p < 1:
        probs, order = torch.softmax(x, -1).sort(descending=True)
        drop = (probs.cumsum(-1) - probs) >= sp.top_p
        x[order[drop]] = -math.inf
    return torch.isfinite(x)


def test_filters_match_full_sort_reference() -> None:
    """The top-`width` shortcut and the full-sort fallback both agree with a plain reference."""
    vocab, num_rows = 1000, 240
    g = torch.Generator().manual_seed(11)
    scales = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.arange(num_rows) % 4]
    logits = torch.randn(num_rows, vocab, generator=g) * scales[:, None]  # [num_rows, vocab]
    reqs = []
    for i in range(num_rows):
        reqs.append(
            make_request(
                f"f{i}",
                temperature=(0.5, 1.0, 1.5)[i % 3],
                top_k=(0, 5, 50, 300, 0)[i % 5],
                top_p=(1.0, 0.5, 0.9, 0.99, 0.3, 0.95, 1.0)[i % 7],
                min_p=(0.0, 0.0, 0.05)[i % 3 if i % 2 else 0],
            )
        )
    got = torch.isfinite(Sampler.process_random(logits.clone(), reqs))
    want = torch.stack([_reference_kept(logits[i], r.sampling_params) for i, r in enumerate(reqs)])
    assert torch.equal(got, want)
    kept = want.sum(-1)
    assert kept.max() > 256 and kept.min() >= 1  # some rows needed the full-sort fallback


# ---------------------------------------------------------------------- penalties


def test_penalties_hand_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 4.0, 1.0, -2.0, 0.5]])
    req = make_request(
        prompt=[0, 1],
        output=[1, 2, 2],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    Sampler._apply_penalties(logits, [req])
    # repetition over prompt+output {0,1,2}: 2/2=1, -1*2=-2, 4/2=2
    # output counts {1: 1, 2: 2}: token 1 -= .25*1 + .5; token 2 -= .25*2 + .5
    want = torch.tensor([[1.0, -2.75, 1.0, 1.0, -2.0, 0.5]])
    assert torch.equal(logits, want)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    plain = make_request(output=[0], prompt=[3], logprobs=True)
    assert Sampler()(logits, [plain]).token_ids == [0]
    for params in (dict(repetition_penalty=1.1), dict(presence_penalty=0.2), dict(frequency_penalty=0.2)):
        out = Sampler()(logits, [make_request(output=[0], prompt=[3], logprobs=True, **params)])
        assert out.token_ids == [1], params
    # frequency penalty counts repeats; presence does not; both ignore the prompt
    out = Sampler()(logits, [make_request(prompt=[0, 0, 0], frequency_penalty=2.0)])
    assert out.token_ids == [0]
    penalised = torch.tensor([[3.0 - 0.5 * 3, 2.9, 0.0, 0.0]])
    out = Sampler()(logits, [make_request(output=[0, 0, 0], frequency_penalty=0.5, logprobs=True)])
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(penalised, -1)[0, 1]), abs=1e-6)


def test_penalties_only_touch_their_rows() -> None:
    logits = random_logits(3, seed=4)
    reqs = [
        make_request("a", output=[5, 6], prompt=[7]),
        make_request("b", output=[5, 6], prompt=[7], repetition_penalty=3.0, frequency_penalty=1.0),
        make_request("c"),
    ]
    copy = logits.clone()
    Sampler._apply_penalties(copy, reqs)
    assert torch.equal(copy[0], logits[0]) and torch.equal(copy[2], logits[2])
    assert not torch.equal(copy[1], logits[1])


# ---------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    eos, stop_id = 0, 1
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])

    def sample(num_outputs: int, **params) -> int:
        req = make_request(output=[2] * num_outputs, eos_token_id=eos, stop_token_ids=[stop_id], **params)
        return Sampler()(logits, [req]).token_ids[0]

    assert sample(0, min_tokens=2, max_tokens=5) == 2  # eos and stop id masked
    assert sample(1, min_tokens=2, max_tokens=5) == 2
    assert sample(2, min_tokens=2, max_tokens=5) == eos  # min_tokens reached
    assert sample(0) == eos  # no min_tokens
    # ignore_eos: EOS does not end the request, so it is not masked; stop ids still are
    assert sample(0, min_tokens=2, max_tokens=5, ignore_eos=True) == eos
    logits[0, 0] = -1.0
    assert sample(0, min_tokens=2, max_tokens=5, ignore_eos=True) == 2
    # also for sampled rows: the masked ids are never drawn
    reqs = [
        make_request(f"x{i}", eos_token_id=eos, stop_token_ids=[stop_id], min_tokens=1, temperature=5.0)
        for i in range(2000)
    ]
    out = Sampler(seed=0)(torch.tensor([[5.0, 4.0, 3.0, 0.0]]).repeat(2000, 1), reqs).token_ids
    assert set(out) == {2, 3}


def test_empty_batch() -> None:
    assert Sampler()(torch.empty(0, VOCAB), []) == SamplerOutput(token_ids=[], logprobs=None)


# ---------------------------------------------------------------------- logit_bias


def test_logit_bias_bans_and_forces_tokens_for_its_own_row_only() -> None:
    logits = random_logits(3, seed=7)
    best = logits.argmax(dim=-1).tolist()  # [3]
    forced = (best[1] + 1) % VOCAB
    requests = [make_request("banned", logit_bias={best[0]: -100.0}),
                make_request("forced", logit_bias={forced: 100.0}),
                make_request("plain")]
    out = Sampler()(logits, requests)
    second_best = logits[0].clone()
    second_best[best[0]] = -math.inf
    assert out.token_ids == [int(second_best.argmax()), forced, best[2]]


def test_logit_bias_shifts_a_sampled_rows_logprobs_by_the_bias() -> None:
    logits = torch.zeros(1, VOCAB)  # [1, vocab]: uniform
    out = Sampler()(logits, [make_request(logit_bias={5: 2.0}, logprobs=True, top_logprobs=1, seed=3,
                                          temperature=1.0)])
    [(top_id, top_logprob)] = out.top_logprobs[0]
    expected = 2.0 - math.log(VOCAB - 1 + math.exp(2.0))
    assert top_id == 5 and math.isclose(top_logprob, expected, rel_tol=1e-5)
