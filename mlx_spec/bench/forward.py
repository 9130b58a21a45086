"""Cost of one model forward: decode time per token, bandwidth share, verify-cost curve.

The verify-cost curve is the time of one forward over T tokens after a
realistic KV prefix, relative to T = 1: near 1 for small T when decoding is
memory-bound (weights are read once for all T tokens), close to T when it is
compute-bound. The cache is rewound after every timed forward (host metadata
only), so every repeat sees the same prefix. The same measurement over
(B, T) inputs gives the batch curve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import mlx.core as mx

from ..attention import round_attention
from ..cache import describe_kinds, make_cache, make_rewindable, rewind, rewind_plan
from ..loading import vocab_size
from ..memory import model_bytes
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP, interleaved_medians, ratio

DEFAULT_VERIFY_LENGTHS = (1, 2, 4, 8, 16, 32)
DEFAULT_CONTEXT_LENGTH = 512
# Compute-bound from the first step whose cost grows at least half as fast as the
# token count (doubling the tokens costs >= 1.5x): the weights no longer dominate.
KNEE_FRACTION = 0.5


@dataclass(frozen=True)
class ModelCost:
    role: str  # "target" or "draft"
    weight_bytes: int
    context_length: int
    decode_s: float  # median time of one forward over 1 token
    bandwidth_share: float  # (weight bytes / decode_s) / measured read bandwidth
    verify_s: Dict[int, float] = field(default_factory=dict)  # T -> median seconds
    verify_cost: Dict[int, float] = field(default_factory=dict)  # T -> time(T) / time(1)
    compute_bound_at: Optional[int] = None  # see knee()
    cache_kinds: str = ""  # e.g. "6 ArraysCache, 2 KVCache"
    rewind: str = ""  # how a rejected draft is undone in this model's cache


def prefilled_cache(model, context_length: int, batch: int = 1, seed: int = 0) -> list:
    """A fresh KV cache holding `context_length` random tokens for each of `batch` rows."""
    cache = make_cache(model)
    make_rewindable(cache)  # a sliding window stays trimmable after it wraps
    if context_length > 0:
        tokens = mx.random.randint(0, vocab_size(model), (batch, context_length),
                                   key=mx.random.key(seed)).astype(mx.uint32)
        for start in range(0, context_length, 512):
            model(tokens[:, start:start + 512], cache=cache)
            mx.eval([c.state for c in cache])
    return cache


def forward_seconds(model, cache, lengths: Sequence[int], batch: int = 1,
                    repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                    seed: int = 0) -> Dict[int, float]:
    """Median time of one forward over (batch, T) tokens on top of `cache`, for every T.

    The lengths are interleaved within each repeat, so a background load
    shifts the whole curve rather than bending it.
    """

    def forward(length):
        tokens = mx.random.randint(0, vocab_size(model), (batch, length),
                                   key=mx.random.key(seed + length)).astype(mx.uint32)
        mx.eval(tokens)

        def run():
            with round_attention():  # the attention a verify pass uses (composed on CUDA)
                logits = model(tokens, cache=cache)
            mx.eval(logits)
            rewind(cache, length)

        return run

    return interleaved_medians({t: forward(t) for t in lengths}, repeats, warmup)


def verify_curve(model, lengths: Sequence[int], context_length: int,
                 repeats: int = DEFAULT_REPEATS, seed: int = 0, timed=None) -> Dict[int, float]:
    """Median time of one forward over T tokens after `context_length` tokens, for every T.

    `forward_seconds` on a fresh `prefilled_cache`. `timed`, when given, is
    called in the timed passes instead of `model` (the model as a round
    calls it: with the log-softmax of a verify pass, or a draft step's argmax).
    """
    cache = prefilled_cache(model, context_length, seed=seed)
    return forward_seconds(timed or model, cache, lengths, repeats=repeats, seed=seed)


def knee(curve: Dict[int, float]) -> Optional[int]:
    """First size whose cost grew >= KNEE_FRACTION as fast as the size did, or None."""
    points = sorted(curve.items())
    for (n0, c0), (n1, c1) in zip(points, points[1:]):
        if c0 > 0 and (c1 / c0 - 1) >= KNEE_FRACTION * (n1 / n0 - 1):
            return n1
    return None


def measure_model(role: str, model, read_gbs: float,
                  lengths: Sequence[int] = DEFAULT_VERIFY_LENGTHS,
                  context_length: int = DEFAULT_CONTEXT_LENGTH,
                  repeats: int = DEFAULT_REPEATS, seed: int = 0) -> ModelCost:
    verify_s = verify_curve(model, sorted(set(lengths) | {1}), context_length, repeats, seed)
    weight_bytes = model_bytes(model)
    decode_s = verify_s[1]
    curve = {t: ratio(s, decode_s) for t, s in verify_s.items()}
    share = ratio(weight_bytes / decode_s / 1e9, read_gbs) if decode_s else 0.0
    layers = make_cache(model)
    return ModelCost(role, weight_bytes, context_length, decode_s, share, verify_s, curve,
                     knee(curve), describe_kinds(layers), rewind_plan(layers))


@dataclass(frozen=True)
class BatchPoint:
    batch: int
    tokens_per_row: int
    seconds: float
    relative_cost: float  # time(B, T) / time(1, T)
    tokens_per_s: float


def measure_batch(model, batches: Sequence[int], tokens_per_row: int, context_length: int,
                  repeats: int = DEFAULT_REPEATS, seed: int = 0) -> list:
    """Forward time over B x T tokens as B grows; B rows verified in one pass."""
    points, base = [], None
    for batch in sorted(set(batches) | {1}):
        cache = prefilled_cache(model, context_length, batch=batch, seed=seed)
        seconds = forward_seconds(model, cache, [tokens_per_row], batch, repeats,
                                  seed=seed)[tokens_per_row]
        base = base or seconds
        points.append(BatchPoint(batch, tokens_per_row, seconds, ratio(seconds, base),
                                 ratio(batch * tokens_per_row, seconds)))
        del cache
        mx.clear_cache()
    return points
