"""Memory bandwidth: streaming read and copy of an array well above cache size, in GB/s.

Read is a column sum over the array seen as (rows, READ_COLUMNS): every byte
is read once and the sums vectorise, so CPU reductions do not hide the memory
(a flat sum is compute-bound on some CPUs). Copy is `x + 1` into a new array,
counted as read + write (the STREAM convention). Medians of repeats.
Decoding one token reads every weight once, so this bounds tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .timing import DEFAULT_REPEATS, time_fn

DEFAULT_BANDWIDTH_MB = 512
READ_COLUMNS = 4096


@dataclass(frozen=True)
class Bandwidth:
    size_mb: int
    read_gbs: float
    copy_gbs: float


def measure_bandwidth(size_mb: int = DEFAULT_BANDWIDTH_MB,
                      repeats: int = DEFAULT_REPEATS) -> Bandwidth:
    x = mx.random.uniform(shape=(size_mb * 2**20 // 4,))  # float32
    mx.eval(x)
    rows = x.reshape(-1, READ_COLUMNS)
    read = time_fn(lambda: mx.eval(rows.sum(axis=0)), repeats)
    copy = time_fn(lambda: mx.eval(x + 1), repeats)
    del x, rows
    mx.clear_cache()
    nbytes = size_mb * 2**20
    return Bandwidth(size_mb, nbytes / read / 1e9, 2 * nbytes / copy / 1e9)
