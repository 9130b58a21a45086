"""Prefill: a prompt run through a model in chunks, filling its cache (target, draft or both).

Lives with the caches so that the loop and the draft-model drafter share it
without importing each other.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from .rewind import ModelCache

DEFAULT_PREFILL_STEP_SIZE = 512


def prefill(cache: ModelCache, tokens: List[int], step_size: int,
            progress: Optional[Callable[[int, int], None]] = None,
            followers: Sequence = (), next_token: Optional[int] = None,
            embeddings: Optional[mx.array] = None) -> None:
    """Run `tokens` through the model in chunks, filling its cache.

    `followers` (MTP drafters) are handed each chunk's hidden states with the
    tokens after them (`next_token` follows the last) and evaluated with it.
    `embeddings` (one row per token) are fed in place of the tokens' own.
    """
    after = tokens[1:] + [next_token]
    for start in range(0, len(tokens), step_size):
        chunk = None if embeddings is None else embeddings[start:start + step_size]
        cache.forward(mx.array(tokens[start:start + step_size], mx.uint32), chunk)
        pending = [c.state for c in cache.layers]
        for drafter in followers:
            drafter.follow(after[start:start + step_size], cache.hidden)
            pending += drafter.catch_up()
        mx.eval(pending)
        if progress:
            progress(min(start + step_size, len(tokens)), len(tokens))
    if tokens:  # free the prefill's buffers; with nothing prefilled, keep the warm ones
        mx.clear_cache()
