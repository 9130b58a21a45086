"""Memory bandwidth: streaming read and copy of an array well above cache size, in GB/s.

Read is a sum over the array (bytes read / time); copy is `x + 1` into a new
array, counted as read + write (the STREAM convention). Medians of repeats.
Decoding one token reads every weight once, so this bounds tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .timing import DEFAULT_REPEATS, time_fn

DEFAULT_BANDWIDTH_MB = 512


@dataclass(frozen=True)
class Bandwidth:
    size_mb: int
    read_gbs: float
    copy_gbs: float


def measure_bandwidth(size_mb: int = DEFAULT_BANDWIDTH_MB,
                      repeats: int = DEFAULT_REPEATS) -> Bandwidth:
    x = mx.random.uniform(shape=(size_mb * 2**20 // 4,))  # float32
    mx.eval(x)
    read = time_fn(lambda: mx.eval(x.sum()), repeats)
    copy = time_fn(lambda: mx.eval(x + 1), repeats)
    del x
    mx.clear_cache()
    nbytes = size_mb * 2**20
    return Bandwidth(size_mb, nbytes / read.median_s / 1e9, 2 * nbytes / copy.median_s / 1e9)
