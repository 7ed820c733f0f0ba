"""Speculative decoding's parts without a model (issue 17): prompt lookup, the exactness of
verification (rejection sampling checked by a chi-square test against the target distribution),
and the controller's choice of k from its cost model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from backend.spec_decode.controller import AcceptanceStats, SpeculationController, StepTimeModel
from backend.spec_decode.ngram import NgramProposer, TokenHistory, propose_by_lookup
from backend.spec_decode.verification import race, rejection_sample, verify_greedy, verify_seeded

SIGNIFICANCE = 0.001  # a correct sampler fails one of these tests once in a thousand seeds; the seeds are fixed
TRIALS = 40_000


def lookup(tokens, min_n=1, max_n=4, k=3):
    return propose_by_lookup(np.array(tokens, dtype=np.int64), min_n, max_n, k)


# ----------------------------------------------------------------------------- prompt lookup
def test_lookup_proposes_what_followed_the_longest_earlier_match():
    #         the suffix 2 3 matches at 1..2 (then 4 5 6) and 3 at 6 (then 9): the longer one wins
    assert lookup([1, 2, 3, 4, 5, 6, 3, 9, 2, 3]) == [4, 5, 6]
    assert lookup([1, 2, 3, 4, 5, 6, 3, 9, 2, 3], k=2) == [4, 5]


def test_lookup_respects_min_n_and_finds_nothing_without_a_match():
    assert lookup([1, 2, 3, 4, 9, 3], min_n=2) == []  # only the 1-gram "3" recurs
    assert lookup([1, 2, 3, 4, 9, 3], min_n=1) == [4, 9, 3]
    assert lookup([5, 6, 7, 8]) == []
    assert lookup([7]) == []


def test_lookup_prefers_the_most_recent_match_with_a_full_continuation():
    tokens = [1, 2, 10, 11, 12, 1, 2, 20, 21, 22, 1, 2]
    assert lookup(tokens, min_n=2, k=3) == [20, 21, 22]  # the later of two equal matches
    assert lookup([1, 2, 10, 11, 12, 1, 2, 1, 2], min_n=2, k=3) == [10, 11, 12]  # the later one has 2 tokens left


def test_lookup_caps_the_match_at_max_n():
    tokens = [4, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert lookup(tokens, min_n=1, max_n=2, k=2) == [7, 8]


def test_token_history_grows_and_keeps_earlier_ids():
    history, tokens = TokenHistory(), list(range(300))
    assert history.sync(tokens[:10]).tolist() == tokens[:10]
    assert history.sync(tokens).tolist() == tokens  # past the first buffer
    assert history.sync(tokens + [5]).tolist()[-2:] == [299, 5]


def test_ngram_proposer_forgets_requests_that_left():
    class R:
        def __init__(self, request_id, tokens):
            self.request_id, self.all_token_ids = request_id, tokens

    proposer = NgramProposer(1, 3)
    assert proposer.propose(R("a", [1, 2, 3, 1]), 2) == [2, 3]
    proposer.propose(R("b", [1, 1]), 2)
    proposer.keep_only({"b"})
    assert set(proposer._histories) == {"b"}


# ----------------------------------------------------------------------------- verification
def test_greedy_verification_keeps_the_agreeing_prefix_and_one_target_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted: the bonus token
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # the target's token at the first disagreement
    assert verify_greedy([5, 6], [4]) == [5]
    assert verify_greedy([5], []) == [5]


def _dist(values):
    tensor = torch.tensor(values, dtype=torch.float32)
    return tensor / tensor.sum()


P0 = _dist([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
P1 = _dist([0.05, 0.40, 0.05, 0.30, 0.15, 0.05])
P2 = _dist([0.2, 0.2, 0.2, 0.1, 0.1, 0.2])
Q0 = _dist([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])  # a poorly matched draft
Q1 = _dist([0.30, 0.10, 0.20, 0.20, 0.10, 0.10])


def _check(counts: np.ndarray, expected: torch.Tensor) -> None:
    total = counts.sum()
    probabilities = expected.double().numpy()
    result = chisquare(counts, probabilities / probabilities.sum() * total)
    assert result.pvalue > SIGNIFICANCE, (counts / total, expected, result)


@pytest.mark.parametrize("draft", ["distribution", "point mass"])
def test_rejection_sampling_emits_the_target_distribution(draft):
    """k = 2 proposals drawn from q (or fixed, as prompt lookup's): the first emitted token follows p0;
    the second, when the first proposal was accepted, follows p1 (chi-square, fixed seeds)."""
    target = torch.stack([P0, P1, P2])
    draft_probs = torch.stack([Q0, Q1])
    proposal_generator = torch.Generator().manual_seed(11)
    generator = torch.Generator().manual_seed(12)
    first, second = np.zeros(6), np.zeros(6)
    accepted_first = 0
    for _ in range(TRIALS):
        if draft == "distribution":
            proposals = [int(torch.multinomial(Q0, 1, generator=proposal_generator)),
                         int(torch.multinomial(Q1, 1, generator=proposal_generator))]
            tokens, accepted = rejection_sample(target, proposals, draft_probs, generator)
        else:
            proposals = [2, 3]
            tokens, accepted = rejection_sample(target, proposals, None, generator)
        assert tokens[:accepted] == proposals[:accepted] and len(tokens) == accepted + 1
        first[tokens[0]] += 1
        if accepted >= 1:
            accepted_first += 1
            second[tokens[1]] += 1
    _check(first, P0)
    _check(second, P1)
    if draft == "point mass":  # accepted with probability p0(2) exactly
        assert abs(accepted_first / TRIALS - float(P0[2])) < 4 * (0.25 / TRIALS) ** 0.5


def test_rejection_sampling_accepts_every_proposal_of_a_draft_equal_to_the_target():
    target = torch.stack([P0, P1, P2])
    generator = torch.Generator().manual_seed(3)
    for proposals in ([0, 1], [4, 3], [1, 5]):
        tokens, accepted = rejection_sample(target, proposals, target[:2].clone(), generator)
        assert accepted == 2 and tokens[:2] == proposals


def test_seeded_verification_emits_what_one_token_at_a_time_would():
    """The races of verify_seeded are the sampler's: one vocabulary-sized draw per emitted token."""
    target = torch.stack([P0, P1, P2, P0])
    one_by_one_generator = torch.Generator().manual_seed(99)
    expected = [race(target[i], one_by_one_generator) for i in range(4)]
    generator = torch.Generator().manual_seed(99)
    tokens, accepted = verify_seeded(target, expected[:3], generator)
    assert tokens == expected and accepted == 3
    generator = torch.Generator().manual_seed(99)
    wrong = (expected[1] + 1) % 6
    tokens, accepted = verify_seeded(target, [expected[0], wrong, expected[2]], generator)
    assert tokens == expected[:2] and accepted == 1
    assert race(target[2], generator) == expected[2]  # the generator is where one-by-one sampling leaves it


def test_seeded_verification_is_an_exact_sampler():
    target = torch.stack([P0, P1])
    generator = torch.Generator().manual_seed(5)
    counts = np.zeros(6)
    for _ in range(TRIALS // 4):
        tokens, _ = verify_seeded(target, [2], generator)
        counts[tokens[0]] += 1
    _check(counts, P0)


# ----------------------------------------------------------------------------- the controller
def test_step_time_model_interpolates_and_follows_the_measured_scale():
    model = StepTimeModel([(1, 0.010), (4, 0.011), (16, 0.020), (64, 0.080)])
    assert model.predict(1) == pytest.approx(0.010)
    assert model.predict(10) == pytest.approx(0.0155)
    assert model.predict(128) == pytest.approx(0.160)  # linear past the last point
    for _ in range(50):
        model.observe(16, 0.040)  # the machine got twice as slow
    assert model.predict(16) == pytest.approx(0.040, rel=0.02)


def test_acceptance_stats_expected_tokens():
    stats = AcceptanceStats(3)
    for _ in range(2000):
        stats.observe(3, 3)
    assert stats.expected_tokens(3) == pytest.approx(4.0, rel=0.01)
    for _ in range(2000):
        stats.observe(3, 0)
    assert stats.expected_tokens(3) == pytest.approx(1.0, abs=0.02)


def _controller(acceptance: float, step_time: StepTimeModel, mode: str = "auto") -> SpeculationController:
    controller = SpeculationController(4, mode, step_time)
    for i in range(1000):
        controller.acceptance.observe(4, 4 if i < acceptance * 1000 else 0)
    return controller


FLAT = StepTimeModel([(1, 0.030), (8, 0.031), (32, 0.034), (128, 0.040)])  # bandwidth-bound: tokens are nearly free
LINEAR = StepTimeModel([(1, 0.001), (8, 0.008), (32, 0.032), (128, 0.128)])  # compute-bound: time per token


def test_the_controller_speculates_where_tokens_are_cheap_and_acceptance_high():
    assert _controller(0.8, FLAT).choose([4], 0, 0) == 4
    assert _controller(0.8, FLAT, mode="off").choose([4], 0, 0) == 4


def test_the_controller_stops_where_the_batch_fills_the_machine_or_acceptance_is_low():
    busy = _controller(0.8, LINEAR)
    assert busy.choose([4] * 32, 0, 0) == 0
    assert _controller(0.05, FLAT).choose([4], 0, 0) == 0
    assert _controller(0.05, FLAT, mode="off").choose([4], 0, 0) == 4
    assert busy.num_steps == 1 and busy.num_speculated_steps == 0


def test_a_drafter_turned_off_is_tried_on_one_request_ever_more_rarely():
    controller = SpeculationController(3, "auto", LINEAR, proposal_time=lambda b, k: 1.0, explores=True)
    tries = [step for step in range(2000) if controller.choose([3] * 8, 0, 0) and controller.exploring]
    assert tries[:2] == [32, 32 + 1 + 64]  # waits of 32, then 64, ...
    assert len(tries) <= 7 and controller.num_speculated_steps == len(tries)
