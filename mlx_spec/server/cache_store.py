"""Prompt caches kept between requests, so that a conversation's next turn prefills only its new tokens.

Each entry is a cache list (the target's layers, then the draft's, as
`stream_generate` takes it) keyed by the exact token sequence it holds: after
a call a reused cache holds the prompt and every token the caller was given
(docs/python-api.md, "Reusing a prompt cache across turns"). A new prompt reuses the entry
with the longest key that is a proper prefix of it and sends only the rest.
Nothing is trimmed, so the rule holds for every cache kind, recurrent
(hybrid) layers included.

A cache is used by one request at a time: `take` removes the entry, `put`
stores it again under its new tokens. The store keeps the most recently
stored entries whose caches fit in `max_bytes` (least recently used out
first); a cache larger than the whole budget is not kept. Lookup compares the
prompt with every key (C-speed tuple compares), ample for the dozens of
entries a local server holds. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

from ..cache.rewind import leaves


def cache_nbytes(cache) -> Optional[int]:
    """Bytes held by a cache list's arrays; None when a layer cannot say (then it is not kept)."""
    total = 0
    for layer in leaves(cache):
        try:
            total += int(layer.nbytes)
        except (AttributeError, NotImplementedError, TypeError):  # empty, or a kind without it
            counted = _state_nbytes(layer)
            if counted is None:
                return None
            total += counted
    return total


def _state_nbytes(layer) -> Optional[int]:
    """The bytes of the arrays in a layer's `state` (None: it has none that says)."""
    try:
        state = layer.state
    except Exception:  # a foreign layer: fail closed
        return None
    return _arrays_nbytes(state)


def _arrays_nbytes(value) -> Optional[int]:
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        parts = [_arrays_nbytes(v) for v in value]
        return None if None in parts else sum(parts)
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else None


class PromptCacheStore:
    """LRU store of caches keyed by the tokens they hold, bounded by bytes (and, when
    `max_entries` is given, by how many it holds: mlx-lm's --prompt-cache-size)."""

    def __init__(self, max_bytes: int, max_entries: Optional[int] = None):
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be >= 1 (or None: no limit), got {max_entries}.")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: "OrderedDict[Tuple[int, ...], Tuple[list, int]]" = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def take(self, prompt: Sequence[int]) -> Tuple[Optional[list], int]:
        """(the cache with the longest key that is a proper prefix of `prompt`, key length),
        removed from the store; (None, 0) if there is none."""
        prompt = tuple(prompt)
        with self._lock:
            best = max((key for key in self._entries
                        if len(key) < len(prompt) and prompt[:len(key)] == key),
                       key=len, default=None)
            if best is None:
                return None, 0
            cache, nbytes = self._entries.pop(best)
            self._nbytes -= nbytes
            return cache, len(best)

    def put(self, tokens: Sequence[int], cache: List) -> None:
        """Keep `cache`, which holds exactly `tokens`; evict the least recently stored to fit."""
        key, nbytes = tuple(tokens), cache_nbytes(cache)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old[1]
            if nbytes is None or nbytes > self.max_bytes:  # unknown size: fail closed
                return
            self._entries[key] = (cache, nbytes)
            self._nbytes += nbytes
            while self._nbytes > self.max_bytes or (
                    self.max_entries is not None and len(self._entries) > self.max_entries):
                _, (_, dropped) = self._entries.popitem(last=False)
                self._nbytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes
