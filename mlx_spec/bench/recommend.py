"""The cost model's verdict: predicted vs measured speed-up, the k to use, or why not to speculate.

All maths is `mlx_spec.costmodel`: acceptance from the sweep, the draft's cost
in target decoding steps, and the target's verify-cost curve go in; a
predicted speed-up per k and the best k come out (`block_verdict`: a block
drafter's pass per round instead of a draft step per token). This module only
lays the prediction next to the measurement and words the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence

from .. import costmodel
from .acceptance import AcceptancePoint, iid_rate, lookup
from .forward import ModelCost

PAYS_THRESHOLD = 1.05  # below this predicted speed-up, speculation is not worth the memory
LINEAR_VERIFY = 0.6  # verify cost growing at >= this fraction of T counts as "linear"
SLOW_DRAFT = 0.5  # a draft step costing this many target steps is too slow
SLOW_PASS = 1.0  # a block drafter's pass (all k drafts) costing this many is too slow
LOW_ACCEPTANCE = 0.4  # below this the draft rarely predicts the target


@dataclass(frozen=True)
class Verdict:
    temp: float
    acceptance: float  # per-draft acceptance a (i.i.d. estimate), pooled over k
    draft_cost: float  # one draft step in target decoding steps (block drafter: its pass)
    best_k: int  # 0 = do not speculate
    predicted_best: float
    predicted_by_k: Dict[int, float] = field(default_factory=dict)
    measured_by_k: Dict[int, float] = field(default_factory=dict)
    pays: bool = False
    reason: str = ""


def _reason(pays: bool, k: int, acceptance: float, draft_cost: float,
            verify_cost: Mapping[int, float], predicted: float, block: bool = False) -> str:
    spent = (f"one pass of the DFlash block drafter (all k drafts) costs {draft_cost:.2f} "
             "target steps" if block else f"a draft step costs {draft_cost:.2f} target steps")
    if pays:
        return (f"Speculate with k={k}: per-draft acceptance {acceptance:.0%}, {spent} and "
                f"verifying {k + 1} tokens costs "
                f"{costmodel.interpolate(verify_cost, k + 1):.2f}, so about "
                f"{predicted:.2f}x is expected.")
    t = max(verify_cost)
    growth = (verify_cost[t] - 1) / (t - 1) if t > 1 else 0.0
    why = []
    if growth >= LINEAR_VERIFY:
        why.append(f"verify cost grows almost linearly with T (T={t} costs "
                   f"{verify_cost[t]:.1f}x one token): the forward is compute-bound on this "
                   "device/BLAS, so checking k drafts costs nearly k target steps")
    if block and draft_cost >= SLOW_PASS:
        why.append(f"the drafter's pass is too slow (it costs {draft_cost:.2f} target steps, "
                   "a plain step's worth or more)")
    elif not block and draft_cost >= SLOW_DRAFT:
        why.append(f"the draft is too slow (one step costs {draft_cost:.2f} target steps; "
                   "use a much smaller draft)")
    if acceptance < LOW_ACCEPTANCE:
        why.append(f"acceptance is too low ({acceptance:.0%}: the draft rarely predicts the "
                   "target; use a draft of the same family, trained on similar text)")
    if not why:
        why.append(f"per-draft acceptance {acceptance:.0%}, "
                   f"{'pass' if block else 'draft'} cost {draft_cost:.2f} and verify cost "
                   f"{costmodel.interpolate(verify_cost, 2):.2f} at T=2 together leave at most "
                   f"{predicted:.2f}x")
    best = f"; the best k measured is k={k}, at {predicted:.2f}x" if block and k else ""
    return "Speculation does not pay here: " + "; and ".join(why) + best + "."


def verdict(points: Sequence[AcceptancePoint], target: ModelCost, draft: ModelCost,
            temp: float, ks: Sequence[int],
            measured_by_k: Optional[Mapping[int, float]] = None,
            prompt_names: Optional[Sequence[str]] = None) -> Verdict:
    """Predicted speed-up per k next to the measured one; `prompt_names` restricts the
    acceptance to the prompts the measured runs used, so both sides see the same text."""
    acceptance = _pooled(points, temp, prompt_names)
    draft_cost = draft.decode_s / target.decode_s if target.decode_s else 0.0
    curve = target.verify_cost
    predicted = {k: costmodel.predicted_speedup(a, k, draft_cost, curve)
                 for k, a in _acceptance_by_k(points, temp, ks, prompt_names).items()}
    k_best, s_best = costmodel.best_k(acceptance, draft_cost, curve, k_max=max(ks, default=8))
    pays = k_best > 0 and s_best >= PAYS_THRESHOLD
    return Verdict(temp, acceptance, draft_cost, k_best if pays else 0, s_best, predicted,
                   dict(measured_by_k or {}), pays,
                   _reason(pays, k_best, acceptance, draft_cost, curve, s_best))


def block_verdict(points: Sequence[AcceptancePoint], target: ModelCost,
                  pass_cost: Mapping[int, float], temp: float, ks: Sequence[int],
                  measured_by_k: Optional[Mapping[int, float]] = None,
                  prompt_names: Optional[Sequence[str]] = None) -> Verdict:
    """The same for a block drafter: `pass_cost[k]`, its pass drafting k in target steps, was
    measured at every k of `ks`, and a block drafter's acceptance changes along its block, so
    the best k is the best of `ks`, each predicted with its own acceptance."""
    acceptance = _pooled(points, temp, prompt_names)
    curve = target.verify_cost
    predicted = {k: costmodel.predicted_block_speedup(a, k, pass_cost, curve)
                 for k, a in _acceptance_by_k(points, temp, ks, prompt_names).items()}
    k_best, s_best = max(predicted.items(), key=lambda kv: kv[1], default=(0, 1.0))
    pays = k_best > 0 and s_best >= PAYS_THRESHOLD
    cost = costmodel.interpolate(pass_cost, k_best or max(ks))
    return Verdict(temp, acceptance, cost, k_best if pays else 0, s_best, predicted,
                   dict(measured_by_k or {}), pays,
                   _reason(pays, k_best, acceptance, cost, curve, s_best, block=True))


def _pooled(points, temp, prompt_names) -> float:
    """The exact rule's per-draft acceptance at `temp`, pooled over k."""
    return iid_rate([p for p in points if p.temp == temp and p.rule == "exact"], prompt_names)


def _acceptance_by_k(points, temp, ks, prompt_names) -> Dict[int, float]:
    """Each k's own acceptance where the sweep measured it, else the pooled one."""
    pooled = _pooled(points, temp, prompt_names)
    return {k: iid_rate([point], prompt_names) if point is not None else pooled
            for k, point in ((k, lookup(points, k, temp)) for k in ks)}
