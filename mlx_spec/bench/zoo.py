"""A zoo of target/draft pairs built from the shipped pair: no downloads, seconds to build.

Each pair stresses speculation differently, so that "mlx-spec is never
behind" is checked where a draft pays, where it cannot, and in between:

- shipped-f16: the shipped target and draft as stored (float16);
- shipped-f32: both cast to float32 (on the CPU, float32 products go to BLAS);
- weak: the shipped target with a random-initialised draft of the shipped
  draft's shape (same vocabulary, no skill): acceptance near zero;
- strong: the shipped target with itself quantized to 4 bits as the draft:
  high acceptance, and a draft step is a full-depth forward. The copy is cast
  to float32 before quantizing: MLX's CPU quantized product with float16
  scales measured 37x slower than the dense float16 product (a draft ten
  times dearer than its target), with float32 scales it is fast.

Every pair gets freshly loaded models, so casting or quantizing one pair
never touches another's weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from ..loading import default_draft_path, default_target_path, load

WEAK_DRAFT_SEED = 3
STRONG_DRAFT_GROUP_SIZE, STRONG_DRAFT_BITS = 32, 4
STRONG_DRAFT_DTYPE = mx.float32  # of the scales and activations; see the module docstring


@dataclass(frozen=True)
class Pair:
    name: str
    target_model: object
    draft_model: object
    tokenizer: object
    note: str


def _shipped():
    """(target, draft, tokenizer): fresh float16 copies of the shipped pair."""
    target_model, tokenizer = load(str(default_target_path()))
    draft_model, _ = load(str(default_draft_path()))
    return target_model, draft_model, tokenizer


def random_draft(like, seed: int = WEAK_DRAFT_SEED, dtype=mx.float16):
    """A llama of `like`'s shape and vocabulary with random weights and untied embeddings."""
    args = dataclasses.replace(like.args, tie_word_embeddings=False)
    mx.random.seed(seed)
    draft_model = llama.Model(args)
    draft_model.set_dtype(dtype)
    mx.eval(draft_model.parameters())
    return draft_model


def quantized_copy(path: str, group_size: int = STRONG_DRAFT_GROUP_SIZE,
                   bits: int = STRONG_DRAFT_BITS, dtype=STRONG_DRAFT_DTYPE):
    """A fresh copy of the model at `path`, cast to `dtype`, its linear and embedding layers
    quantized."""
    model, _ = load(path)
    model.set_dtype(dtype)
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def _shipped_f16() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    return Pair("shipped-f16", target_model, draft_model, tokenizer,
                "the shipped target and draft as stored (float16)")


def _shipped_f32() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    target_model.set_dtype(mx.float32)
    draft_model.set_dtype(mx.float32)
    mx.eval(target_model.parameters(), draft_model.parameters())
    return Pair("shipped-f32", target_model, draft_model, tokenizer,
                "the shipped pair cast to float32")


def _weak() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    return Pair("weak", target_model, random_draft(draft_model), tokenizer,
                f"shipped float16 target; random draft of the shipped draft's shape "
                f"(seed {WEAK_DRAFT_SEED}): acceptance near zero")


def _strong() -> Pair:
    target_model, _, tokenizer = _shipped()
    draft_model = quantized_copy(str(default_target_path()))
    return Pair("strong", target_model, draft_model, tokenizer,
                f"shipped float16 target; the target itself quantized to {STRONG_DRAFT_BITS} "
                f"bits (group {STRONG_DRAFT_GROUP_SIZE}, float32 scales) as the draft")


BUILDERS: Dict[str, Callable[[], Pair]] = {
    "shipped-f16": _shipped_f16,
    "shipped-f32": _shipped_f32,
    "weak": _weak,
    "strong": _strong,
}
ZOO_NAMES = tuple(BUILDERS)


def build_zoo(names: Optional[Sequence[str]] = None) -> List[Pair]:
    """The named pairs (all of them by default), in the order asked."""
    names = list(ZOO_NAMES if names is None else names)
    unknown = [name for name in names if name not in BUILDERS]
    if unknown:
        raise ValueError(f"Unknown pair {unknown[0]!r}; choose from {', '.join(ZOO_NAMES)}.")
    return [BUILDERS[name]() for name in names]
