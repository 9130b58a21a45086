"""Timing: the median of repeats after a warm-up, with the device synchronised around it.

`time_fn(fn)` calls `fn` `warmup` times untimed, then `repeats` times timed;
`interleaved_medians` does the same for several fns in turn. A fn must
evaluate what it computes (MLX is lazy: an unevaluated graph costs nothing).
Only medians and ratios of medians are ever reported as headlines.
`time_after_prefill(rounds)` times one generation of mlx-spec's loop from
the end of its first round (which carries the prefill) to the end of its last.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Iterable, Optional, Sequence, Tuple

import mlx.core as mx

DEFAULT_WARMUP = 1
DEFAULT_REPEATS = 5


def interleaved_medians(fns: Dict[Hashable, Callable[[], object]], repeats: int = DEFAULT_REPEATS,
                        warmup: int = DEFAULT_WARMUP) -> Dict[Hashable, float]:
    """Median seconds of each fn, all run in turn within every repeat.

    A background load then slows every fn of a repeat alike, so ratios
    between them (a verify-cost curve) stay meaningful on a busy machine.
    """
    times: Dict[Hashable, list] = {key: [] for key in fns}
    for r in range(warmup + max(1, repeats)):
        for key, fn in fns.items():
            mx.synchronize()
            start = time.perf_counter()
            fn()
            mx.synchronize()
            if r >= warmup:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def time_fn(fn: Callable[[], object], repeats: int = DEFAULT_REPEATS,
            warmup: int = DEFAULT_WARMUP) -> float:
    """Median seconds of `fn` over `repeats` calls after `warmup` untimed ones."""
    return interleaved_medians({"fn": fn}, repeats, warmup)["fn"]


@dataclass(frozen=True)
class Decoded:
    """A generation timed from the end of its first round to the end of its last."""

    seconds: float
    tokens: int  # emitted by the timed rounds
    rounds: int  # timed rounds
    drafted: int  # drafts of the timed rounds
    accepted: int  # accepted drafts of the timed rounds
    first_tokens: int  # emitted by the first, untimed round

    @property
    def tokens_per_s(self) -> float:
        return ratio(self.tokens, self.seconds)


def time_after_prefill(rounds: Iterable, each: Optional[Callable[[object], None]] = None) -> Decoded:
    """Time the rounds of one generation (speculative_generate_step's), its prefill excluded.

    The clock starts as the first round arrives (it carries the prefill and
    the first token) and stops after the last; only the later rounds count.
    `each(round_)`, when given, sees every round as it arrives, the first too.
    """
    start = None
    tokens = count = drafted = accepted = first_tokens = 0
    for round_ in rounds:
        if start is None:  # the first round carries the prefill: not timed
            start = time.perf_counter()
            first_tokens = len(round_.tokens)
        else:
            tokens, count = tokens + len(round_.tokens), count + 1
            drafted, accepted = drafted + round_.num_drafted, accepted + round_.num_accepted
        if each is not None:
            each(round_)
    return Decoded(time.perf_counter() - start, tokens, count, drafted, accepted, first_tokens)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def median_interval(values: Sequence[float], level: float = 0.9) -> Tuple[float, float, float]:
    """(low, high, coverage): a distribution-free confidence interval for the median.

    The j-th smallest and j-th largest of n values bracket the population
    median with probability 1 - 2 P(Binomial(n, 1/2) < j), whatever the
    distribution. The narrowest such pair with coverage >= `level`; with too
    few values for that, the smallest and largest, with their own coverage
    (3 values: 75%, 8 values: 99%; 8 values reach 93% with j = 2).
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return 0.0, 0.0, 0.0

    def coverage(j: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(j)) / 2.0 ** n

    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(j + 1) >= level:
        j += 1
    return xs[j - 1], xs[n - j], coverage(j)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
