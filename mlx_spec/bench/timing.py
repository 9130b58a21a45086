"""Timing: the median of repeats after a warm-up, with the device synchronised around it.

`time_fn(fn)` calls `fn` `warmup` times untimed, then `repeats` times timed;
`interleaved_medians` does the same for several fns in turn. A fn must
evaluate what it computes (MLX is lazy: an unevaluated graph costs nothing).
Only medians and ratios of medians are ever reported as headlines.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Hashable, Sequence

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


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
