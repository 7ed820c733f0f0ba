"""When to speculate, and how far: a cost model of the step and the measured acceptance rate.

Speculation trades compute for latency: a step that verifies k proposals of B requests runs
``B (1 + k)`` tokens instead of ``B``. When decoding is bandwidth-bound (few requests) that costs
little more than one token; when the batch already fills the machine (many requests) it costs
nearly ``1 + k`` times as much and only the accepted tokens pay it back. So each step the
controller predicts, for every k from 0 to the configured maximum,

    tokens(k) = non-speculating decodes + sum over proposing requests of E[accepted + 1 | k]
    time(k)   = step_time(tokens scheduled with k) + proposal cost(k)

and picks the k with the most tokens per second (k = 0: no speculation this step). ``E[accepted + 1
| k] = 1 + sum_{i<=k} a_1 ... a_i`` from the per-position acceptance rates ``a_i`` (exponentially
weighted: the workload changes). ``step_time`` interpolates step times measured at start-up over a
grid of token counts, scaled by how far the recent steps ran from that prediction (the machine is
shared). Prompt lookup's rates keep being measured while it does not speculate: its proposals are
checked against the tokens the target then produced (shadow verification, free). A draft model's
proposals cost a forward each, so when it is off it is tried again after ``EXPLORE_EVERY`` steps,
on one request (``exploring``), and after each try that does not change the verdict the wait
doubles (up to ``MAX_EXPLORE_EVERY``): a drafter that never pays costs almost nothing.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # step sizes timed at start-up
ACCEPTANCE_DECAY = 0.995  # per verified proposal position: about the last 200 count
PRIOR_ACCEPTANCE = 0.5  # before anything is measured (its weight: PRIOR_WEIGHT observations)
PRIOR_WEIGHT = 2.0
SCALE_DECAY = 0.9  # the online correction of the start-up step times
EXPLORE_EVERY = 32  # steps before a draft model the controller turned off is tried again
MAX_EXPLORE_EVERY = 2048


class StepTimeModel:
    """Seconds of a step of T tokens: piecewise linear through measured points, times a scale."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        points = sorted(points)
        self.tokens = [t for t, _ in points]
        self.seconds = [max(s, 1e-6) for _, s in points]
        self.scale = 1.0

    @classmethod
    def calibrate(cls, time_step: Callable[[int], float], tokens: Sequence[int] = CALIBRATION_TOKENS) -> StepTimeModel:
        """``time_step(T)``: seconds of one step of T new tokens (the best of a few runs)."""
        return cls([(t, time_step(t)) for t in tokens])

    def predict(self, num_tokens: int) -> float:
        tokens, seconds = self.tokens, self.seconds
        if len(tokens) == 1:
            return self.scale * seconds[0] * max(1.0, num_tokens / tokens[0])
        i = bisect.bisect_left(tokens, num_tokens)
        i = min(max(i, 1), len(tokens) - 1)
        t0, t1, s0, s1 = tokens[i - 1], tokens[i], seconds[i - 1], seconds[i]
        value = s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)
        return self.scale * max(value, seconds[0] if num_tokens >= tokens[0] else 1e-6)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` took ``seconds``: moves the scale towards their ratio."""
        base = self.predict(num_tokens) / self.scale
        if base > 0 and seconds > 0:
            ratio = min(max(seconds / base, 0.2), 5.0)
            self.scale = SCALE_DECAY * self.scale + (1 - SCALE_DECAY) * ratio


class AcceptanceStats:
    """Per-position acceptance rates: a_i = P(proposal i accepted | proposals before it accepted)."""

    def __init__(self, max_k: int) -> None:
        self.accepted = [PRIOR_ACCEPTANCE * PRIOR_WEIGHT] * max_k
        self.tried = [PRIOR_WEIGHT] * max_k

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One verification (or shadow check): positions 1..accepted+1 were tried (of num_proposed)."""
        for i in range(min(num_proposed, num_accepted + 1, len(self.tried))):
            self.tried[i] = self.tried[i] * ACCEPTANCE_DECAY + 1.0
            self.accepted[i] = self.accepted[i] * ACCEPTANCE_DECAY + (1.0 if i < num_accepted else 0.0)

    def rate(self, position: int) -> float:
        return self.accepted[position] / self.tried[position]

    def expected_tokens(self, k: int) -> float:
        """E[accepted + 1] with k proposals."""
        total, chain = 1.0, 1.0
        for i in range(k):
            chain *= self.rate(i)
            total += chain
        return total


class SpeculationController:
    """Picks this step's k (0: do not speculate) from the cost model; ``mode`` off: always max_k."""

    def __init__(self, max_k: int, mode: str, step_time: StepTimeModel | None,
                 proposal_time: Callable[[int, int], float] | None = None, explores: bool = False) -> None:
        self.max_k = max_k
        self.mode = mode
        self.step_time = step_time
        self.proposal_time = proposal_time  # (requests, k) -> seconds of proposing; None: free
        self.explores = explores
        self.acceptance = AcceptanceStats(max_k)
        self.num_steps = 0  # steps with a request that could speculate
        self.num_speculated_steps = 0
        self.exploring = False  # this step's k = 1 is a try of a drafter the model turned off
        self._since_speculated = 0
        self._explore_every = EXPLORE_EVERY

    def choose(self, proposal_lengths: Sequence[int], other_tokens: int, other_decodes: int) -> int:
        """k for this step. proposal_lengths: the most each proposing request could propose;
        other_tokens / other_decodes: the step's remaining tokens and how many of them are decodes."""
        self.num_steps += 1
        self.exploring = False
        if self.mode == "off" or self.step_time is None:
            k = self.max_k
        else:
            k = self._best_k(proposal_lengths, other_tokens, other_decodes)
            if k:
                self._explore_every = EXPLORE_EVERY  # the model wants it again: back to trying often
            elif self.explores and self._since_speculated >= self._explore_every:
                k, self.exploring = 1, True
                self._explore_every = min(2 * self._explore_every, MAX_EXPLORE_EVERY)
        if k:
            self.num_speculated_steps += 1
            self._since_speculated = 0
        else:
            self._since_speculated += 1
        return k

    def _best_k(self, lengths: Sequence[int], other_tokens: int, other_decodes: int) -> int:
        best_k, best_rate = 0, -1.0
        for k in range(self.max_k + 1):
            used = [min(k, n) for n in lengths]
            tokens = other_decodes + sum(self.acceptance.expected_tokens(u) for u in used)
            seconds = self.step_time.predict(other_tokens + sum(1 + u for u in used))
            if k and self.proposal_time is not None:
                seconds += self.proposal_time(len(lengths), k)
            rate = tokens / seconds
            if rate > best_rate * 1.001:  # a bigger k must win by more than rounding
                best_k, best_rate = k, rate
        return best_k
