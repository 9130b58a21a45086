"""The cost model's verdict: predicted vs measured speed-up, the k to use, or why not to speculate.

All maths is `mlx_spec.costmodel`: acceptance from the sweep, the draft's cost
in target decoding steps, and the target's verify-cost curve go in; a
predicted speed-up per k and the best k come out. This module only lays the
prediction next to the measurement and words the reason.
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
LOW_ACCEPTANCE = 0.4  # below this the draft rarely predicts the target


@dataclass(frozen=True)
class Verdict:
    temp: float
    acceptance: float  # per-draft acceptance a (i.i.d. estimate), pooled over k
    draft_cost: float  # one draft step in target decoding steps
    best_k: int  # 0 = do not speculate
    predicted_best: float
    predicted_by_k: Dict[int, float] = field(default_factory=dict)
    measured_by_k: Dict[int, float] = field(default_factory=dict)
    pays: bool = False
    reason: str = ""


def _reason(pays: bool, k: int, acceptance: float, draft_cost: float,
            verify_cost: Mapping[int, float], predicted: float) -> str:
    if pays:
        return (f"Speculate with k={k}: per-draft acceptance {acceptance:.0%}, a draft step costs "
                f"{draft_cost:.2f} target steps and verifying {k + 1} tokens costs "
                f"{costmodel.interpolate(verify_cost, k + 1):.2f}, so about "
                f"{predicted:.2f}x is expected.")
    t = max(verify_cost)
    growth = (verify_cost[t] - 1) / (t - 1) if t > 1 else 0.0
    why = []
    if growth >= LINEAR_VERIFY:
        why.append(f"verify cost grows almost linearly with T (T={t} costs "
                   f"{verify_cost[t]:.1f}x one token): the forward is compute-bound on this "
                   "device/BLAS, so checking k drafts costs nearly k target steps")
    if draft_cost >= SLOW_DRAFT:
        why.append(f"the draft is too slow (one step costs {draft_cost:.2f} target steps; "
                   "use a much smaller draft)")
    if acceptance < LOW_ACCEPTANCE:
        why.append(f"acceptance is too low ({acceptance:.0%}: the draft rarely predicts the "
                   "target; use a draft of the same family, trained on similar text)")
    if not why:
        why.append(f"per-draft acceptance {acceptance:.0%}, draft cost {draft_cost:.2f} and verify cost "
                   f"{costmodel.interpolate(verify_cost, 2):.2f} at T=2 together leave at most "
                   f"{predicted:.2f}x")
    return "Speculation does not pay here: " + "; and ".join(why) + "."


def verdict(points: Sequence[AcceptancePoint], target: ModelCost, draft: ModelCost,
            temp: float, ks: Sequence[int],
            measured_by_k: Optional[Mapping[int, float]] = None,
            prompt_names: Optional[Sequence[str]] = None) -> Verdict:
    """Predicted speed-up per k next to the measured one; `prompt_names` restricts the
    acceptance to the prompts the measured runs used, so both sides see the same text."""
    exact = [p for p in points if p.temp == temp and p.rule == "exact"]
    acceptance = iid_rate(exact, prompt_names)
    draft_cost = draft.decode_s / target.decode_s if target.decode_s else 0.0
    curve = target.verify_cost
    predicted = {}
    for k in ks:
        point = lookup(points, k, temp)
        a = iid_rate([point], prompt_names) if point is not None else acceptance
        predicted[k] = costmodel.predicted_speedup(a, k, draft_cost, curve)
    k_best, s_best = costmodel.best_k(acceptance, draft_cost, curve, k_max=max(ks, default=8))
    pays = k_best > 0 and s_best >= PAYS_THRESHOLD
    return Verdict(temp, acceptance, draft_cost, k_best if pays else 0, s_best, predicted,
                   dict(measured_by_k or {}), pays,
                   _reason(pays, k_best, acceptance, draft_cost, curve, s_best))
