"""Attention for a round's short multi-token passes (the verify pass, the draft's catch-up).

On MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` over more than
one query sets up a cuDNN graph per (queries, keys) shape. A verify pass meets
a new key length every round, so every round paid that set-up: on an H200 the
shipped pair decoded an order of magnitude slower on a prompt seen for the
first time than on the same prompt repeated, and the same attention composed
from two matmuls and a softmax was faster than either (measured by hand when
the swap was made; no results file was kept).

`round_attention()` therefore swaps in the composed form for queries of 2 to
SHORT_QUERIES tokens while the round's lazy graph is built, on the CUDA backend
only: Metal's fused kernel has no per-shape set-up, and on the CPU (where the
fused call already runs this composition) both measured the same. One-token
decoding and long prefills keep the fused kernel. The swap is undone before
control returns to the caller; MLX code running in other threads during a
round would see it too.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from typing import Optional

import mlx.core as mx

SHORT_QUERIES = 64  # verify passes are k + 1 <= 33 tokens; longer passes are prefills


def composed_attention(q, k, v, *, scale: float, mask=None):
    """softmax(q k^T * scale + mask) v from matmuls, as MLX's own reference form.

    q: (B, N_q, L, D); k, v: (B, N_kv, S, D) with N_q a multiple of N_kv (GQA).
    `mask` is None, "causal" (query i sees keys up to S - L + i), a boolean
    array (True = attend) or an additive array, broadcastable to (B, N_q, L, S).
    """
    B, n_q, L, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    q = (q * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    scores = q @ k[:, :, None].swapaxes(-1, -2)  # (B, N_kv, rep, L, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"Unsupported attention mask {mask!r}.")
        visible = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        scores = mx.where(visible, scores, mx.finfo(scores.dtype).min)
    elif mask is not None:
        if mask.ndim >= 3:  # split its head axis as the scores' (N_kv, rep), or add one
            *lead, heads, rows, cols = mask.shape
            mask = (mask.reshape(*lead, n_kv, n_q // n_kv, rows, cols) if heads == n_q > 1
                    else mx.expand_dims(mask, -3))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v[:, :, None]).reshape(B, n_q, L, D)


@lru_cache(maxsize=1)
def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


def _needs_composed() -> bool:  # asked twice a round: the CUDA probe is asked once
    return mx.default_device().type == mx.DeviceType.gpu and _cuda_available()


@contextmanager
def round_attention(enabled: Optional[bool] = None):
    """Route 2..SHORT_QUERIES-token attention to `composed_attention` inside the block.

    enabled: None decides by backend (CUDA only); True/False force it (tests).
    """
    if not (_needs_composed() if enabled is None else enabled):
        yield
        return
    fused = mx.fast.scaled_dot_product_attention

    def attention(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
        if sinks is not None or kwargs or not 1 < q.shape[2] <= SHORT_QUERIES:
            return fused(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
        return composed_attention(q, k, v, scale=scale, mask=mask)

    mx.fast.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = fused
