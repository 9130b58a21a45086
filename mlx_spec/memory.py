"""Both models share one unified-memory pool: wire it for the pair while generating."""

from __future__ import annotations

import contextlib

import mlx.core as mx
from mlx.utils import tree_reduce


def model_bytes(model) -> int:
    return tree_reduce(
        lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, model, 0
    )


@contextlib.contextmanager
def wired_limit(*models):
    """On Metal, wire enough memory for all models' weights together; elsewhere a no-op."""
    if not mx.metal.is_available():
        yield
        return
    limit = mx.device_info().get("max_recommended_working_set_size")
    if limit is None:
        yield
        return
    needed = sum(model_bytes(m) for m in models if m is not None)
    # Weights of both models plus headroom for the two KV caches.
    old = mx.set_wired_limit(min(limit, int(needed * 1.25)) if needed else limit)
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)
