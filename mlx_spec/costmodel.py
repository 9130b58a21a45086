"""The speculative cost model: is drafting k tokens worth it on this machine?

With i.i.d. acceptance a, a round with k drafts emits on average
(1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023) and costs
k draft steps plus one target pass over k+1 tokens. In units of one plain
target decoding step:

    speed-up(k) = E[tokens per round] / (k * draft_cost + verify_cost(k + 1))

`verify_cost(T)` is the measured time of one target forward over T tokens
relative to T = 1; on a GPU it stays near 1 for small T, on a reference CPU
BLAS it grows like T, which erases any gain.

A block drafter (DFlash) drafts all k in ONE pass over its block, so its round
costs that pass plus the same verify, roughly constant in k:

    block speed-up(k) = E[tokens per round] / (pass_cost(k) + verify_cost(k + 1))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Tuple


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tree_tokens(acceptance: float, k: int, rescued: float) -> float:
    """Tokens a round emits from a spine of k drafts, each kept with `acceptance`, with
    siblings beside each spine node that keep one token with chance `rescued` where the
    spine's draft was rejected (the policy's E_s(k, w), one a for every depth)."""
    tokens, survive = 1.0, 1.0
    for _ in range(k):
        tokens += survive * (acceptance + (1.0 - acceptance) * rescued)
        survive *= acceptance
    return tokens


def iid_acceptance(accepted: int, rounds: int, full_rounds: int) -> float:
    """The per-draft acceptance a that best explains observed rounds (the i.i.d. MLE).

    Each round accepts drafts until its first rejection; rounds that accepted
    all k drafts saw no rejection. So a = accepted / (accepted + rejections).
    Plain accepted / drafted underestimates a, because drafts after a
    rejection are never judged.
    """
    rejections = rounds - full_rounds
    total = accepted + rejections
    return accepted / total if total else 0.0


def interpolate(curve: Mapping[int, float], t: int) -> float:
    """Relative cost at T tokens from measured points (linear in between, beyond the ends)."""
    if t in curve:
        return curve[t]
    points = sorted(curve.items())
    if len(points) == 1:
        return points[0][1] * t / points[0][0]
    lo = max((p for p in points if p[0] < t), default=points[0], key=lambda p: p[0])
    hi = min((p for p in points if p[0] > t), default=points[-1], key=lambda p: p[0])
    if lo[0] == hi[0]:  # extrapolate from the last two points
        lo, hi = points[-2], points[-1]
    slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
    return lo[1] + slope * (t - lo[0])


def predicted_speedup(acceptance: float, k: int, draft_cost: float,
                      verify_cost: Mapping[int, float]) -> float:
    """Speed-up over plain decoding for k drafts per round (k = 0 is plain: 1.0)."""
    if k == 0:
        return 1.0
    return expected_tokens_per_round(acceptance, k) / round_cost(k, draft_cost, k + 1,
                                                                 verify_cost)


def round_cost(draft_steps: int, draft_cost: float, verified: int,
               verify_cost: Mapping[int, float]) -> float:
    """A round in plain target steps: `draft_steps` draft steps, then one verify pass over
    `verified` tokens (relative to a pass over one)."""
    return draft_steps * draft_cost + interpolate(verify_cost, verified) / interpolate(
        verify_cost, 1)


def predicted_tree_speedup(acceptance: float, k: int, width: int, rescued: float,
                           draft_cost: float, verify_cost: Mapping[int, float]) -> float:
    """Speed-up over plain decoding for a draft model's tree of depth k and `width` (a spine
    of k drafts, width - 1 sibling leaves beside each spine node, `rescued` the chance they
    keep a token where the spine's draft was rejected): E(k, w) over k draft steps (the
    draft pays for the spine only) plus one verify pass over 1 + k w tokens. Width 1 is the
    chain (`predicted_speedup`)."""
    if k == 0:
        return 1.0
    return expected_tree_tokens(acceptance, k, rescued if width > 1 else 0.0) / round_cost(
        k, draft_cost, 1 + k * width, verify_cost)


def block_round_cost(pass_cost: float, k: int, verify_cost: Mapping[int, float]) -> float:
    """One block-drafter round in plain target steps: the drafter's pass drafting k (one pass,
    whatever k), then the target's verify over k + 1 tokens."""
    return pass_cost + round_cost(0, 0.0, k + 1, verify_cost)


def predicted_block_speedup(acceptance: float, k: int, pass_cost: Mapping[int, float],
                            verify_cost: Mapping[int, float]) -> float:
    """Speed-up over plain decoding for a block drafter proposing k per round (k = 0: 1.0);
    `pass_cost[k]`: its pass drafting k, in target steps (interpolated between measured k)."""
    if k == 0:
        return 1.0
    return (expected_tokens_per_round(acceptance, k)
            / block_round_cost(interpolate(pass_cost, k), k, verify_cost))


def best_k(acceptance: float, draft_cost: float, verify_cost: Mapping[int, float],
           k_max: int = 8) -> Tuple[int, float]:
    """The k in [0, k_max] with the highest predicted speed-up (0 = do not speculate)."""
    return max(
        ((k, predicted_speedup(acceptance, k, draft_cost, verify_cost)) for k in range(k_max + 1)),
        key=lambda kv: kv[1],
    )


@dataclass(frozen=True)
class CostPrior:
    """Seconds a calibration measured on this machine: where the adaptive policy starts.

    A round drafting k tokens from `source` costs the loop's own overhead per
    step (a plain step less a one-token pass), one target pass over k + 1
    tokens, and k draft steps of that source (none for prompt lookup), plus
    `extra_seconds`: what a real round measured beyond those parts, and at
    T > 0 what sampling adds (may be negative; a round never costs less than
    its verify pass).
    """

    plain_seconds: float
    verify_seconds: Mapping[int, float]  # T -> seconds of one target pass over T tokens
    step_seconds: Mapping[str, float]  # source -> seconds per drafted token ("lookup": 0)
    acceptance: Mapping[str, float] = field(default_factory=dict)  # source -> per-draft a
    extra_seconds: Mapping[str, float] = field(default_factory=dict)  # source -> per round

    def knows(self, source: str) -> bool:
        return source in self.step_seconds

    def round_seconds(self, source: str, k: int) -> float:
        one = interpolate(self.verify_seconds, 1)
        verify = interpolate(self.verify_seconds, k + 1)
        overhead = max(self.plain_seconds - one, 0.0) + self.extra_seconds.get(source, 0.0)
        return max(overhead + verify + k * self.step_seconds[source], verify)
