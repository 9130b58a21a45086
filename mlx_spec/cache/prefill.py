"""Prefill: a prompt run through a model in chunks, filling its cache (target, draft or both).

Lives with the caches so that the loop and the draft-model drafter share it
without importing each other.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from .rewind import ModelCache
from .window import prefilling

# The look's rows are a chunk of their own only when the chunk they would end is this long: a
# forward and its sync cost ~2 plain steps on a CPU's small float32 targets (the look 17.1 ms with
# its own chunk, 9.3 without, after 40 tokens; 18.5 and 16.8 after 150), and the last layer over
# a chunk's rows grows with it (after 500 tokens: 14.1 ms with, 59.5 without;
# bench/results/look-chunking-openblas.md).
TAIL_CHUNK_FROM = 128


def prefill(cache: ModelCache, tokens: List[int], step_size: int,
            progress: Optional[Callable[[int, int], None]] = None,
            followers: Sequence = (), next_token: Optional[int] = None,
            embeddings: Optional[mx.array] = None, tail: int = 0,
            settle: Optional[Callable[[], None]] = None) -> None:
    """Run `tokens` through the model in chunks, filling its cache.

    `followers` (MTP drafters) are handed each chunk's hidden states with the
    tokens after them (`next_token` follows the last) and evaluated with it.
    `embeddings` (one row per token) are fed in place of the tokens' own.
    `tail` > 0: the last `tail` tokens are a chunk of their own. The prompt look
    reads the hidden states of the last chunk's last rows, and the caches need
    no layer past the last one's keys and values: its attention and MLP then
    run over those rows only, not over a chunk of up to `step_size`.
    `settle()` runs after each chunk's forward (mlx-lm's KV quantization: quantize.py).
    """
    after = tokens[1:] + [next_token]
    for start, end in chunks(len(tokens), step_size, tail):
        chunk = None if embeddings is None else embeddings[start:end]
        with prefilling(cache.trimmable):  # (windows that keep a prefix: mlx-lm's chunk rule)
            cache.forward(mx.array(tokens[start:end], mx.uint32), chunk)
        if settle is not None:
            settle()
        pending = [c.state for c in cache.layers]
        for drafter in followers:
            drafter.follow(after[start:end], cache.hidden)
            pending += drafter.catch_up()
        mx.eval(pending)
        if progress:
            progress(end, len(tokens))
    if tokens:  # free the prefill's buffers; with nothing prefilled, keep the warm ones
        mx.clear_cache()


def chunks(n: int, step_size: int, tail: int = 0) -> List[Tuple[int, int]]:
    """(start, end) of each chunk of `n` tokens: `step_size` at most, the last `tail` (at most
    `step_size`) a chunk of their own when the chunk they would end has TAIL_CHUNK_FROM tokens
    or more."""
    tail = min(tail, step_size)
    last = n - (n - 1) // step_size * step_size if n else 0  # the last chunk, undivided
    head = n - tail if 0 < tail < n and last >= TAIL_CHUNK_FROM else n
    bounds = [(start, min(start + step_size, head)) for start in range(0, head, step_size)]
    return bounds + ([(head, n)] if head < n else [])
