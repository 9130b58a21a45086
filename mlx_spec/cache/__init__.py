"""Rewindable caches for every cache kind mlx-lm builds.

- `make_cache(model)`: mlx-lm's own cache list for `model`.
- `make_rewindable(layers)`: sliding-window layers become `WindowKVCache`
  (rewindable after they wrap); in place, so a caller's prompt cache stays usable.
- `ModelCache`: a model with its cache list; anchors, feeds, keeps a prefix,
  checkpoints and restores, whatever the layer kinds (see rewind.py).
- `check_prompt_cache`: a caller's prompt cache must match the models it is used with.
"""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models.cache import make_prompt_cache

from .rewind import (Checkpoint, ModelCache, cache_length, is_recurrent, leaves, make_rewindable,
                     unsupported_kinds)
from .window import DEFAULT_RESERVE, WindowKVCache

__all__ = ["make_cache", "make_rewindable", "ModelCache", "Checkpoint", "WindowKVCache",
           "check_prompt_cache", "cache_length", "rewind", "describe_kinds", "DEFAULT_RESERVE"]


def make_cache(model) -> List[Any]:
    return make_prompt_cache(model)


def rewind(layers, num_tokens: int) -> None:
    """Drop the last `num_tokens` entries of every attention layer (host metadata only)."""
    if num_tokens > 0:
        for layer in leaves(layers):
            if not is_recurrent(layer):
                layer.trim(num_tokens)


def describe_kinds(layers) -> str:
    """'12 KVCache, 36 ArraysCache' -- what a cache list is made of."""
    counts = {}
    for layer in leaves(layers):
        name = type(layer).__name__
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


# Attention caches stand in for one another (mlx-lm's max_kv_size and kv_bits swap them).
_SAME_KIND = {name: "attention" for name in ("RotatingKVCache", "WindowKVCache", "KVCache",
                                             "QuantizedKVCache", "ConcatenateKVCache")}


def _kind(layer) -> str:
    name = type(layer).__name__
    return _SAME_KIND.get(name, name)


def check_prompt_cache(layers, model, role: str) -> None:
    """Raise ValueError unless `layers` is a cache list `model` could have made."""
    expected = make_cache(model)
    if len(layers) != len(expected):
        raise ValueError(
            f"prompt_cache holds {len(layers)} layers for the {role} model, which makes "
            f"{len(expected)}; build it with make_prompt_cache(model) for each model "
            "(target first, then the draft).")
    for i, (got, want) in enumerate(zip(layers, expected)):
        if _kind(got) != _kind(want):
            raise ValueError(
                f"prompt_cache layer {i} of the {role} model is a {type(got).__name__} where "
                f"the model makes a {type(want).__name__}; build it with make_prompt_cache(model).")
    bad = unsupported_kinds(layers)
    if bad:
        raise ValueError(f"The {role} model's cache has layers of a kind mlx-spec cannot rewind "
                         f"({', '.join(bad)}).")
