"""Rewindable caches for every cache kind mlx-lm builds.

- `make_cache(model)`: mlx-lm's own cache list for `model`.
- `make_rewindable(layers)`: sliding-window layers become `WindowKVCache`
  (rewindable after they wrap); in place, so a caller's prompt cache stays usable.
- `ModelCache`: a model with its cache list; anchors, feeds, keeps a prefix,
  checkpoints and restores, whatever the layer kinds (see rewind.py).
- `check_prompt_cache`: a caller's prompt cache must match the models it is used with.
"""

from __future__ import annotations

from typing import Any, List, Optional

from mlx_lm.models.cache import make_prompt_cache

from .rewind import (Checkpoint, ModelCache, cache_length, is_recurrent, leaves, make_rewindable,
                     unsupported_kinds)
from .window import DEFAULT_RESERVE, WindowKVCache

__all__ = ["make_cache", "make_rewindable", "ModelCache", "Checkpoint", "WindowKVCache",
           "check_prompt_cache", "check_rewindable", "cache_length", "rewind", "describe_kinds", "rewind_plan",
           "DEFAULT_RESERVE"]


def make_cache(model, max_kv_size: Optional[int] = None) -> List[Any]:
    """mlx-lm's cache list for `model` (a sliding window of `max_kv_size` where mlx-lm makes one)."""
    return make_prompt_cache(model, max_kv_size)


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
def rewind_plan(layers) -> str:
    """How a rejected draft is undone in these layers, in a few words (for reports)."""
    kinds = {type(c).__name__ for c in leaves(layers)}
    plan = ["trim"]
    if kinds & {"RotatingKVCache", "WindowKVCache"}:
        plan.append("sliding window with a reserve")
    if any(is_recurrent(c) for c in leaves(layers)):
        plan.append("recurrent state restored + mixers replayed")
    return ", ".join(plan)


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
    check_rewindable(layers, role)


def check_rewindable(layers, role: str) -> None:
    """One sentence for a cache kind no rewind path handles (none that mlx-lm's common
    families build; e.g. deepseek_v41's compressed LayerCache)."""
    bad = unsupported_kinds(layers)
    if bad:
        raise ValueError(
            f"The {role} model's cache has layers of a kind mlx-spec cannot rewind "
            f"({', '.join(bad)}: neither trimmable nor recurrent state), so rejected drafts "
            "could not be undone; decode it without a draft model or prompt lookup.")
