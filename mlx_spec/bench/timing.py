"""Timing: the median of repeats after a warm-up, with the device synchronised around it.

`time_fn(fn)` calls `fn` `warmup` times untimed, then `repeats` times timed;
`fn` must evaluate what it computes (MLX is lazy: an unevaluated graph costs
nothing). Only medians and ratios of medians are ever reported as headlines.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

DEFAULT_WARMUP = 1
DEFAULT_REPEATS = 5


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    repeats: int


def time_fn(fn: Callable[[], object], repeats: int = DEFAULT_REPEATS,
            warmup: int = DEFAULT_WARMUP) -> Timing:
    for _ in range(warmup):
        fn()
    mx.synchronize()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), len(times))


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
