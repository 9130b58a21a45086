"""Acceptance sweep: rate, mean accepted length and accepted-length histogram per (k, temp).

Runs mlx-spec's own loop over the fixed prompt set. At T > 0 it also runs the
same loop with mlx-lm's token-match rule swapped in (`accept=token_match_accept`),
so the two rules are compared on identical drafts, models and prompts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .. import costmodel
from ..acceptance import token_match_accept
from ..generate import speculative_generate_step
from ..sampling import SamplingConfig
from .prompts import Prompt

DEFAULT_KS = (1, 2, 3, 4, 6, 8)
DEFAULT_TEMPS = (0.0, 0.7, 1.0)
RULES = {"exact": None, "token-match": token_match_accept}


@dataclass(frozen=True)
class AcceptancePoint:
    k: int
    temp: float
    rule: str  # "exact" (mlx-spec) or "token-match" (mlx-lm's rule in our loop)
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted: float  # accepted drafts per round
    accepted_histogram: Tuple[int, ...]  # [n] = rounds that accepted n drafts
    by_kind: Dict[str, float] = field(default_factory=dict)  # prompt kind -> acceptance rate
    # prompt name -> (rounds, accepted, rounds that accepted all k): the iid fit per prompt
    by_prompt: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)


def _run(prompt_ids, target_model, draft_model, k, temp, max_tokens, accept, **options):
    """Counts of one generation: (drafted, accepted, Counter of accepted lengths).

    The generator is asked for k + 1 tokens more than we read, so no round we
    count had its draft cut short by the end: every round drafts exactly k.
    """
    drafted = accepted = emitted = 0
    histogram: Counter = Counter()
    for round_ in speculative_generate_step(
        prompt_ids, target_model, draft_model, max_tokens=max_tokens + k + 1, num_draft_tokens=k,
        sampling=SamplingConfig(temp=temp), accept=accept, prompt_lookup=False, **options,
    ):
        if round_.num_drafted:
            drafted += round_.num_drafted
            accepted += round_.num_accepted
            histogram[round_.num_accepted] += 1
        emitted += len(round_.tokens)
        if emitted >= max_tokens:
            break
    return drafted, accepted, histogram


def measure_point(target_model, draft_model, prompts: Sequence[Tuple[Prompt, List[int]]],
                  k: int, temp: float, max_tokens: int, rule: str = "exact",
                  seed: int = 0, **options) -> AcceptancePoint:
    """Acceptance of `draft_model` at (k, temp) over `prompts`; `options` go to the generator
    (e.g. draft_model="mtp" with mtp_weights=...)."""
    drafted = accepted = 0
    histogram: Counter = Counter()
    kind_counts: Dict[str, List[int]] = {}
    by_prompt: Dict[str, Tuple[int, int, int]] = {}
    for i, (prompt, ids) in enumerate(prompts):
        mx.random.seed(seed + i)
        d, a, h = _run(ids, target_model, draft_model, k, temp, max_tokens, RULES[rule],
                       **options)
        drafted, accepted = drafted + d, accepted + a
        histogram.update(h)
        by_prompt[prompt.name] = (sum(h.values()), a, h[k])
        counts = kind_counts.setdefault(prompt.kind, [0, 0])
        counts[0], counts[1] = counts[0] + d, counts[1] + a
    rounds = sum(histogram.values())
    return AcceptancePoint(
        k=k, temp=temp, rule=rule, rounds=rounds, drafted=drafted, accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted=accepted / rounds if rounds else 0.0,
        accepted_histogram=tuple(histogram[n] for n in range(k + 1)),
        by_kind={kind: a / d if d else 0.0 for kind, (d, a) in kind_counts.items()},
        by_prompt=by_prompt,
    )


def measure_acceptance(target_model, draft_model, prompts, ks: Sequence[int] = DEFAULT_KS,
                       temps: Sequence[float] = DEFAULT_TEMPS, max_tokens: int = 64,
                       seed: int = 0, token_match: bool = True,
                       progress: Optional[Callable[[str], None]] = None) -> List[AcceptancePoint]:
    """Every (k, temp) point; at temp > 0 also the token-match rule when `token_match`."""
    plan = [(k, t, rule) for t in temps for k in ks
            for rule in (("exact", "token-match") if t > 0 and token_match else ("exact",))]
    points = []
    for i, (k, temp, rule) in enumerate(plan):
        if progress:
            progress(f"acceptance {i + 1}/{len(plan)}: k={k} T={temp} {rule}")
        points.append(measure_point(target_model, draft_model, prompts, k, temp, max_tokens,
                                    rule, seed))
    return points


def lookup(points: Sequence[AcceptancePoint], k: int, temp: float,
           rule: str = "exact") -> Optional[AcceptancePoint]:
    for p in points:
        if p.k == k and p.temp == temp and p.rule == rule:
            return p
    return None


def iid_rate(points: Sequence[AcceptancePoint], prompt_names: Optional[Sequence[str]] = None) -> float:
    """Per-draft acceptance a explaining these points' histograms (the cost model's input).

    Rounds stop at their first rejection, so accepted / drafted underestimates
    a; `costmodel.iid_acceptance` counts rejections instead. With
    `prompt_names`, only those prompts count (where the points recorded them).
    """
    if prompt_names and all(set(prompt_names) <= p.by_prompt.keys() for p in points):
        rows = [p.by_prompt[name] for p in points for name in prompt_names]
        return costmodel.iid_acceptance(sum(r[1] for r in rows), sum(r[0] for r in rows),
                                        sum(r[2] for r in rows))
    return costmodel.iid_acceptance(sum(p.accepted for p in points),
                                    sum(p.rounds for p in points),
                                    sum(p.accepted_histogram[-1] for p in points))
