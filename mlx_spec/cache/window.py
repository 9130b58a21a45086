"""A sliding-window KV cache that can be rewound after it wraps.

mlx-lm's `RotatingKVCache` keeps exactly the last `max_size` entries in a
ring, so once it wraps a rejected draft has already overwritten an entry that
a rewind would bring back into the window: it cannot be trimmed. This cache
keeps the entries in time order with a reserve of `reserve` extra entries
behind the window, so any rewind of up to `reserve` tokens is host metadata
only (the offset moves back), exactly as for a plain `KVCache`. Attention
sees the same window as plain decoding: the mask hides what is older than
`max_size - keep` tokens (the first `keep` tokens stay visible, as in mlx-lm).
That rule is `visible` (any query and key positions) over `key_positions` (the
position of each key a pass is shown, in buffer order), so a token tree's mask
(tree_verify) is built from the same two. A prompt chunk (`prefilling`) is masked
as mlx-lm masks one where a prefix is kept (max_kv_size's attention sinks): a
window of `max_size` over its ring's buffer, where a kept token is seen only while
it is that close in the buffer (`_chunk_mask`); decoding steps and verify passes
by `visible`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, _BaseCache

DEFAULT_RESERVE = 64  # rewind budget after a wrap: k + 1 of any round must fit
STEP = 256  # buffer growth and compaction granularity


def visible(query_pos: mx.array, key_pos: mx.array, window: Optional[int],
            keep: int = 0) -> mx.array:
    """(Q, K) bool: whether a query at absolute position query_pos[q] sees the key at
    key_pos[k] under a sliding window of `window` tokens (itself included; None: no window)
    whose first `keep` positions stay visible, as in mlx-lm's RotatingKVCache. Leading axes
    broadcast: (B, Q) queries and (B, K) keys give (B, Q, K)."""
    q, k = query_pos[..., :, None], key_pos[..., None, :]  # (..., Q, 1), (..., 1, K)
    if window is None:
        return k <= q
    return (k <= q) & ((q - k < window) | (k < keep))


@contextmanager
def prefilling(layers):
    """Inside the block, forwards are a prompt's chunks: the sliding windows in `layers` that
    keep a prefix mask them as mlx-lm's RotatingKVCache masks a chunk (`_chunk_mask`), so a
    prompt longer than the window fills the cache as mlx-lm's prefill does."""
    marked = [layer for layer in layers if isinstance(layer, WindowKVCache) and layer.keep]
    for layer in marked:
        layer.prefilling = True
    try:
        yield
    finally:
        for layer in marked:
            del layer.prefilling


def keeps_prefix(layers) -> bool:
    """Whether any sliding window in `layers` keeps a prefix (mlx-lm's max_kv_size): its
    prompt is then prefilled in mlx-lm's chunks, whose ends decide what a chunk sees."""
    return any(isinstance(layer, (WindowKVCache, RotatingKVCache)) and layer.keep
               for layer in layers)


class WindowKVCache(_BaseCache):
    """Duck-typed like mlx-lm's caches: update_and_fetch, offset, trim, make_mask."""

    def __init__(self, max_size: int, keep: int = 0, reserve: int = DEFAULT_RESERVE):
        if not 0 <= keep < max_size:
            raise ValueError(f"keep must be in [0, max_size), got {keep} for max_size {max_size}.")
        self.max_size = max_size
        self.keep = keep
        self.reserve = reserve
        self.keys = None
        self.values = None
        self.offset = 0  # tokens seen (absolute position of the next token)
        self.start = keep  # absolute position of the first non-keep entry in the buffer
        self.written = 0  # buffer entries holding data (>= the entries in use)
        self._shown_last = None  # (first, end) the last update returned (keys_and_values)

    # -- layout: buffer[:keep] = positions [0, keep); buffer[keep:] = [start, offset)

    @property
    def used(self) -> int:
        """Buffer entries in use (the layout above): the newest entry is row used - 1."""
        return self.keep + self.offset - self.start if self.offset > self.keep else self.offset

    def _start_after(self, num_new: int) -> int:
        """Where the buffer will start after appending `num_new` (shared by mask and update)."""
        if self.offset <= self.keep:
            return self.keep
        # Entries the next queries and any rewind of `reserve` tokens may still need.
        needed_from = max(self.keep, self.offset - (self.max_size - self.keep) + 1 - self.reserve)
        capacity = self.max_size + self.reserve + STEP
        if self.used + num_new <= capacity or needed_from <= self.start:
            return self.start
        return needed_from

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        num_new = keys.shape[2]
        new_start = self._start_after(num_new)
        if self.keys is None:
            self.keys, self.values = keys, values
            self.written = num_new
        else:
            used = self.used
            if new_start > self.start:  # compact: drop what no query or rewind can need
                drop = new_start - self.start
                self.keys = mx.concatenate(
                    [self.keys[..., : self.keep, :], self.keys[..., self.keep + drop: used, :]], axis=2)
                self.values = mx.concatenate(
                    [self.values[..., : self.keep, :], self.values[..., self.keep + drop: used, :]], axis=2)
                self.start = new_start
                used -= drop
            if used + num_new > self.keys.shape[2]:
                grow = ((num_new + STEP - 1) // STEP) * STEP
                shape_k = (*self.keys.shape[:2], used + grow, self.keys.shape[3])
                shape_v = (*self.values.shape[:2], used + grow, self.values.shape[3])
                k_buf = mx.zeros(shape_k, keys.dtype)
                v_buf = mx.zeros(shape_v, values.dtype)
                k_buf[..., :used, :] = self.keys[..., :used, :]
                v_buf[..., :used, :] = self.values[..., :used, :]
                self.keys, self.values = k_buf, v_buf
            self.keys[..., used: used + num_new, :] = keys
            self.values[..., used: used + num_new, :] = values
            self.written = used + num_new
        if self.offset <= self.keep:
            self.start = self.keep
        self.offset += num_new
        used = self.used
        first = self._first_shown(num_new, used)
        self._shown_last = (first, used)
        return self.keys[..., first:used, :], self.values[..., first:used, :]

    def keys_and_values(self):
        """The keys and values the last update_and_fetch returned (what its queries were shown,
        in buffer order): what a layer sharing this one's cache reads in the same pass (Gemma
        3n's KV-shared layers), under the same mask."""
        if self._shown_last is None:  # (none since the last rewind: what one query is shown)
            used = self.used
            first = self._first_shown(1, used)
        else:
            first, used = self._shown_last
        return self.keys[..., first:used, :], self.values[..., first:used, :]

    def _first_shown(self, num_new: int, used: int) -> int:
        """The first buffer entry a pass of `num_new` queries is shown. One query (a plain step,
        a draft step) with no kept prefix sees only the last `max_size` entries, as from
        mlx-lm's ring: attending over the reserve behind the window (and a mask for it) made a
        plain step over a window of 16 cost ~5% more than mlx-lm's."""
        return max(used - self.max_size, 0) if self._window_only(num_new) else 0

    def _window_only(self, num_queries: int) -> bool:
        """Whether a pass is shown only the last max_size entries (see _first_shown)."""
        return num_queries == 1 and self.keep == 0

    def window(self, window_size: Optional[int] = None) -> int:
        """How far back a query sees (itself included) past the kept prefix: the model's
        `window_size` where it asks for one, never more than the cache holds."""
        return min(window_size or self.max_size, self.max_size - self.keep)

    def _shown(self, N: int):
        """(kept entries, oldest position after them) of the keys the next `N` queries get."""
        end = self.offset + N
        num_kept = min(self.keep, end)
        start = self._start_after(N) if self.offset > self.keep else self.keep
        oldest = max(start, num_kept)  # oldest position after the kept prefix
        if self._window_only(N):  # only the last max_size entries are shown (_first_shown)
            oldest = max(oldest, end - self.max_size)
        return num_kept, oldest

    def key_positions(self, N: int) -> mx.array:
        """(K,) the absolute position of each key update_and_fetch will return to the next
        `N` queries, in buffer order: the kept prefix, then the oldest shown up to offset + N
        (the N new entries last)."""
        num_kept, oldest = self._shown(N)
        return mx.concatenate([mx.arange(num_kept), mx.arange(oldest, self.offset + N)])

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask for the next `N` queries over the keys update_and_fetch will return."""
        window = self.window(window_size)
        _, oldest = self._shown(N)
        if N == 1 and not return_array and oldest >= self.offset - window + 1:
            return None  # one query that sees every key
        query_pos = mx.arange(self.offset, self.offset + N)
        if self.prefilling and self.keep and N > 1:
            return self._chunk_mask(query_pos, self.key_positions(N))
        return visible(query_pos, self.key_positions(N), window, self.keep)  # (N, K)

    prefilling = False  # a prompt chunk's pass (`prefilling`): mlx-lm's chunk rule

    def _chunk_mask(self, query_pos: mx.array, key_pos: mx.array) -> mx.array:
        """(N, K) what mlx-lm's RotatingKVCache shows a prompt chunk's queries where it keeps
        a prefix (max_kv_size's attention sinks): its chunk update lays the kept prefix and
        the last max_size - 1 - keep older tokens in front of the chunk, and its mask is a
        window of max_size over that buffer's indices, so a query sees the last max_size
        positions, a kept token only while it is that close in the buffer (its decoding
        steps, one token each, see the kept prefix always: `visible`). Position p's index in
        that buffer: p for the kept prefix or before the cache holds max_size - 1 tokens;
        else p - offset + max_size - 1, shown when at least `keep`."""
        old = self.offset  # tokens before the chunk
        held = min(old, self.max_size - 1)
        q = query_pos[:, None] - old + held  # (N, 1) the queries' buffer indices
        k = key_pos[None, :]
        index = k if old <= self.max_size - 1 else mx.where(k < self.keep, k,
                                                             k - old + self.max_size - 1)
        shown = (k < self.keep) | (index >= self.keep)
        return shown & (index <= q) & (q - index < self.max_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens; allowed while their window is still in the buffer."""
        n = min(self.offset, n)
        if self.start > max(self.keep, self.offset - n - (self.max_size - self.keep) + 1):
            raise ValueError(
                f"Cannot rewind a sliding-window cache by {n} tokens: only {self.reserve} "
                "entries are kept behind the window; raise the reserve.")
        self.offset -= n
        self._shown_last = None  # (what it showed held entries now rejected)
        return n

    def untrim(self, n: int) -> None:
        """Take back a trim of `n` tokens whose entries were not overwritten since."""
        if self.used + n > self.written:
            raise ValueError("Cannot take back a trim over entries that were overwritten.")
        self.offset += n
        self._shown_last = None

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        used = self.used
        return self.keys[..., :used, :], self.values[..., :used, :]

    @property
    def meta_state(self):
        return tuple(map(str, (self.max_size, self.keep, self.reserve, self.offset, self.start)))

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @classmethod
    def from_rotating(cls, rotating: RotatingKVCache, reserve: int = DEFAULT_RESERVE):
        """The same window as a (possibly filled, possibly wrapped) RotatingKVCache."""
        cache = cls(rotating.max_size, rotating.keep, reserve)
        if rotating.keys is None or rotating.offset == 0:
            return cache
        keys = rotating._temporal_order(rotating.keys)
        values = rotating._temporal_order(rotating.values)
        held = min(rotating.offset, keys.shape[2])
        keys, values = keys[..., :held, :], values[..., :held, :]
        cache.keys, cache.values = keys, values
        cache.offset = rotating.offset
        cache.start = rotating.offset - (held - rotating.keep) if rotating.offset > rotating.keep \
            else rotating.keep
        cache.written = held
        return cache

    def to_rotating(self) -> RotatingKVCache:
        """The same window as mlx-lm's RotatingKVCache (the inverse of `from_rotating`).

        The ring mlx-lm's own decoding leaves, in time order: the first `keep`
        entries, then the last `max_size - keep` (every entry before it wraps),
        with `_idx` at its end and the same `offset`, `keep` and `max_size`. So
        mlx-lm goes on from it as from its own: a one-token step overwrites the
        oldest entry after the kept ones, a multi-token pass keeps the last
        `max_size - 1` (mlx-lm's `_temporal_order` returns the ring as is), a
        trim before the wrap moves `offset` and `_idx` back together. The
        entries are slices of this cache's buffer: lazy, no copy, no host sync.
        """
        rotating = RotatingKVCache(self.max_size, self.keep)
        if self.keys is None or self.offset == 0:
            return rotating
        held = min(self.offset, self.max_size)
        keys, values = self.keys, self.values
        if self.offset <= self.keep:  # only the kept prefix so far
            keys, values = keys[..., :held, :], values[..., :held, :]
        else:
            first = self.offset - (held - self.keep)  # the oldest position after the kept ones
            used = self.used
            skip = first - self.start  # entries older than the window in the buffer
            parts_k = [keys[..., : self.keep, :]] if self.keep else []
            parts_v = [values[..., : self.keep, :]] if self.keep else []
            if skip < 0:
                # Only after a rewind to the very edge of the reserve: the entry just out of
                # the window is gone. mlx-lm overwrites (one token) or drops (several) that
                # oldest slot before any query reads it, so zeros stand in for it.
                parts_k.append(mx.zeros((*keys.shape[:2], -skip, keys.shape[3]), keys.dtype))
                parts_v.append(mx.zeros((*values.shape[:2], -skip, values.shape[3]),
                                        values.dtype))
                skip = 0
            parts_k.append(keys[..., self.keep + skip: used, :])
            parts_v.append(values[..., self.keep + skip: used, :])
            keys = parts_k[0] if len(parts_k) == 1 else mx.concatenate(parts_k, axis=2)
            values = parts_v[0] if len(parts_v) == 1 else mx.concatenate(parts_v, axis=2)
        rotating.keys, rotating.values = keys, values
        rotating.offset = self.offset
        rotating._idx = held
        return rotating
