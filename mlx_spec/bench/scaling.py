"""How the speed-up scales with context length, target size and batch size.

Speed-up vs k and temperature come from the acceptance sweep, the cost model
and the measured k sweep; this module adds the timing-only axes:

- context length: target and draft forwards after longer KV prefixes;
- target size: synthetic random-weight llamas of growing size (timing only,
  their text is noise), predicted speed-up with the real pair's acceptance;
- batch size: one forward over B rows of k+1 tokens; where it turns compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from .. import costmodel
from ..loading import vocab_size
from ..memory import model_bytes
from .forward import BatchPoint, forward_seconds, knee, measure_batch, prefilled_cache
from .timing import DEFAULT_REPEATS, ratio

DEFAULT_CONTEXT_LENGTHS = (128, 512, 2048, 4096)
DEFAULT_TARGET_SIZES = ((512, 8), (1024, 16), (2048, 16), (3072, 24))  # (hidden, layers)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ContextPoint:
    context_length: int
    target_decode_s: float
    verify_cost: float  # time(k+1 tokens) / time(1 token), target
    draft_cost: float  # draft step / target step
    predicted_speedup: float


@dataclass(frozen=True)
class SizePoint:
    hidden_size: int
    num_layers: int
    weight_bytes: int
    decode_s: float
    bandwidth_share: float
    verify_cost: float  # time(k+1) / time(1)
    draft_cost: float
    predicted_speedup: float


@dataclass(frozen=True)
class BatchScaling:
    tokens_per_row: int
    points: Tuple[BatchPoint, ...]
    compute_bound_at: Optional[int]  # first B where doubling B costs >= 1.5x


def step_costs(model, context_length, k, repeats, seed):
    """Median seconds of one forward over 1 and over k + 1 tokens after `context_length`."""
    cache = prefilled_cache(model, context_length, seed=seed)
    seconds = forward_seconds(model, cache, sorted({1, k + 1}), repeats=repeats, seed=seed)
    del cache
    mx.clear_cache()
    return seconds[1], seconds[k + 1]


def context_scaling(target_model, draft_model, acceptance: float, k: int,
                    lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
                    repeats: int = DEFAULT_REPEATS, seed: int = 0,
                    progress=None, draft_seconds=None, predict=None) -> List[ContextPoint]:
    """`draft_seconds(length)` and `predict(draft_cost, curve)`, when given, replace the draft
    model's step and the per-token cost model (a block drafter's pass: block_drafter)."""
    draft_seconds = draft_seconds or (
        lambda length: step_costs(draft_model, length, 0, repeats, seed)[0])
    predict = predict or (
        lambda cost, curve: costmodel.predicted_speedup(acceptance, k, cost, curve))
    points = []
    for length in lengths:
        if progress:
            progress(f"context {length}")
        target_one, target_verify = step_costs(target_model, length, k, repeats, seed)
        curve = {1: 1.0, k + 1: ratio(target_verify, target_one)}
        draft_cost = ratio(draft_seconds(length), target_one)
        points.append(ContextPoint(length, target_one, curve[k + 1], draft_cost,
                                   predict(draft_cost, curve)))
    return points


def synthetic_target(hidden: int, layers: int, vocab: int, dtype=mx.float16, seed: int = 0):
    """A random-weight llama of the given size (for timing only)."""
    heads = max(1, hidden // 64)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=hidden * 3, num_attention_heads=heads, rms_norm_eps=1e-5,
        vocab_size=vocab, num_key_value_heads=heads // 4 if heads % 4 == 0 else heads,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def size_scaling(draft_model, reference_model, draft_decode_s: float, acceptance: float, k: int,
                 read_gbs: float, context_length: int,
                 sizes: Sequence[Tuple[int, int]] = DEFAULT_TARGET_SIZES,
                 repeats: int = DEFAULT_REPEATS, seed: int = 0, progress=None) -> List[SizePoint]:
    """Synthetic targets of growing size against the real draft's measured step time."""
    dtype = next(v.dtype for _, v in tree_flatten(reference_model.parameters())
                 if v.dtype in (mx.float16, mx.bfloat16, mx.float32))
    points = []
    for hidden, layers in sizes:
        if progress:
            progress(f"synthetic target hidden={hidden} layers={layers}")
        model = synthetic_target(hidden, layers, vocab_size(reference_model), dtype, seed)
        one, verify = step_costs(model, context_length, k, repeats, seed)
        nbytes = model_bytes(model)
        curve = {1: 1.0, k + 1: ratio(verify, one)}
        draft_cost = ratio(draft_decode_s, one)
        points.append(SizePoint(
            hidden, layers, nbytes, one, ratio(nbytes / one / 1e9, read_gbs) if one else 0.0,
            curve[k + 1], draft_cost,
            costmodel.predicted_speedup(acceptance, k, draft_cost, curve)))
        del model
        mx.clear_cache()
    return points


def batch_scaling(target_model, k: int, context_length: int,
                  batches: Sequence[int] = DEFAULT_BATCH_SIZES,
                  repeats: int = DEFAULT_REPEATS, seed: int = 0) -> BatchScaling:
    points = measure_batch(target_model, batches, k + 1, context_length, repeats, seed)
    curve = {p.batch: p.relative_cost for p in points}
    return BatchScaling(k + 1, tuple(points), knee(curve))
