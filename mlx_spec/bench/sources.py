"""Where drafts come from, and who picks k: one interleaved race over the whole prompt set.

Methods (all through mlx-spec's own loop, so they differ only in drafting):
plain decoding, the draft model at each fixed k, the adaptive policy,
prompt lookup alone, and prompt lookup in front of the draft model.
Every repeat runs every method on every prompt in turn; a run is timed from
its first emitted token (prefill excluded) to `max_tokens`. Each method's
figure per prompt kind is the median tokens/s over repeats, and its speed-up
is the geometric mean over prompts of (method / plain) on the same prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..generate import speculative_generate_step
from ..memory import wired_limit
from ..sampling import SamplingConfig
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP, median, ratio, time_after_prefill

PLAIN, ADAPTIVE, LOOKUP, LOOKUP_DRAFT = "plain", "adaptive", "lookup", "lookup+draft"


def fixed(k: int) -> str:
    return f"draft k={k}"


@dataclass(frozen=True)
class SourceResult:
    method: str
    speedup: Dict[str, float]  # prompt kind (and "all") -> geometric-mean speed-up over plain
    tokens_per_s: Dict[str, float]  # prompt kind -> median tokens/s
    acceptance_rate: Optional[float]
    lookup_share: Optional[float]  # accepted tokens that came from prompt lookup
    mean_k: Optional[float]


@dataclass(frozen=True)
class SourcesRace:
    temp: float
    max_tokens: int
    results: List[SourceResult]
    best_fixed: str  # the fixed-k method with the highest overall speed-up
    adaptive_vs_best_fixed: float  # overall speed-up ratio


def _run(target_model, draft_model, ids, temp, max_tokens, **options) -> Tuple[float, dict]:
    stats = {"drafted": 0, "accepted": 0, "lookup": 0, "ks": []}  # every round, the first too

    def count(round_):
        stats["drafted"] += round_.num_drafted
        stats["accepted"] += round_.num_accepted
        stats["lookup"] += round_.num_accepted if round_.source == "lookup" else 0
        if round_.num_drafted:
            stats["ks"].append(round_.num_drafted)

    decoded = time_after_prefill(speculative_generate_step(
        ids, target_model, draft_model, max_tokens=max_tokens,
        sampling=SamplingConfig(temp=temp), **options), count)
    return decoded.tokens_per_s, stats


def methods_for(ks: Sequence[int]) -> Dict[str, dict]:
    """Method name -> options for speculative_generate_step (draft model used unless None)."""
    methods = {PLAIN: {"use_draft": False, "prompt_lookup": False}}
    methods.update({fixed(k): {"num_draft_tokens": k, "prompt_lookup": False} for k in ks})
    methods[ADAPTIVE] = {"adaptive": True, "prompt_lookup": False}
    methods[LOOKUP] = {"use_draft": False, "prompt_lookup": True}
    methods[LOOKUP_DRAFT] = {"prompt_lookup": True, "adaptive": True}
    return methods


def race(target_model, draft_model, prompts, ks: Sequence[int], temp: float = 0.0,
         max_tokens: int = 128, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
         seed: int = 0, progress: Optional[Callable[[str], None]] = None) -> SourcesRace:
    methods = methods_for(ks)
    tps: Dict[Tuple[str, int], List[float]] = {}
    totals = {name: {"drafted": 0, "accepted": 0, "lookup": 0, "ks": []} for name in methods}
    with wired_limit(target_model, draft_model):
        for r in range(warmup + repeats):
            if progress:
                progress(f"sources: {'warm-up' if r < warmup else f'repeat {r + 1 - warmup}/{repeats}'}")
            for p, (_prompt, ids) in enumerate(prompts):
                for name, options in methods.items():
                    options = dict(options)
                    draft = draft_model if options.pop("use_draft", True) else None
                    mx.random.seed(seed + r)
                    rate, stats = _run(target_model, draft, ids, temp, max_tokens, **options)
                    if r < warmup:
                        continue
                    tps.setdefault((name, p), []).append(rate)
                    for key in ("drafted", "accepted", "lookup"):
                        totals[name][key] += stats[key]
                    totals[name]["ks"] += stats["ks"]
    kinds = sorted({prompt.kind for prompt, _ in prompts})
    results = []
    for name in methods:
        per_prompt = {p: median(tps[(name, p)]) for p in range(len(prompts))}
        speedups = {p: ratio(per_prompt[p], median(tps[(PLAIN, p)])) for p in per_prompt}
        by_kind = {kind: [p for p, (prompt, _) in enumerate(prompts) if prompt.kind == kind]
                   for kind in kinds}
        t = totals[name]
        results.append(SourceResult(
            method=name,
            speedup={**{kind: _geomean([speedups[p] for p in ps]) for kind, ps in by_kind.items()},
                     "all": _geomean(list(speedups.values()))},
            tokens_per_s={kind: median([per_prompt[p] for p in ps]) for kind, ps in by_kind.items()},
            acceptance_rate=ratio(t["accepted"], t["drafted"]) if t["drafted"] else None,
            lookup_share=ratio(t["lookup"], t["accepted"]) if t["accepted"] else None,
            mean_k=sum(t["ks"]) / len(t["ks"]) if t["ks"] else None,
        ))
    overall = {res.method: res.speedup["all"] for res in results}
    best_fixed = max((fixed(k) for k in ks), key=overall.get)
    return SourcesRace(temp, max_tokens, results, best_fixed,
                       ratio(overall[ADAPTIVE], overall[best_fixed]))


def _geomean(values: List[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else 0.0
