"""Rewindable KV caches: the check before generating and the rewind after each round.

mlx-lm's cache protocol is duck-typed: `offset`, `is_trimmable()`, `trim(n)`.
Rewinding is host metadata only (the offset moves back); no device work.
"""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

__all__ = ["make_cache", "check_rewindable", "rewind"]


def make_cache(model) -> List[Any]:
    return make_prompt_cache(model)


def _can_wrap(layer, needed_tokens: int) -> bool:
    """A sliding-window layer stays rewindable only while it never wraps."""
    max_size = getattr(layer, "max_size", None)
    if max_size is None:
        return False
    return getattr(layer, "offset", 0) + needed_tokens > max_size


def check_rewindable(cache: List[Any], role: str, needed_tokens: int) -> None:
    """Raise ValueError unless every layer can be rewound for the whole generation.

    `needed_tokens` is how far the cache will grow (prompt + max_tokens + k).
    Recurrent/SSM state cannot be rewound at all; a sliding window only while
    it has not wrapped around.
    """
    bad = sorted(
        {
            type(layer).__name__
            for layer in cache
            if not (hasattr(layer, "trim") and layer.is_trimmable())
            or _can_wrap(layer, needed_tokens)
        }
    )
    if bad:
        raise ValueError(
            f"The {role} model's cache cannot be rewound ({', '.join(bad)} layers: "
            "recurrent state, or a sliding window that would wrap), so rejected "
            "drafts cannot be undone; speculative decoding needs a plain KV cache. "
            "Use a transformer model with full attention, or decode without a draft."
        )


def rewind(cache: List[Any], num_tokens: int) -> None:
    """Drop the last `num_tokens` entries of every layer (host metadata only)."""
    if num_tokens > 0:
        trim_prompt_cache(cache, num_tokens)
