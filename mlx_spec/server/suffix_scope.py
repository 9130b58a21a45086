"""Which suffix index a server request drafts from, so that one user's text is never drafted
into another's stream; and the file the indexes are kept in between runs.

A request with suffix drafting on drafts from an index that its own prompt and
output then join (mlx_spec/drafters/suffix.py). A draft is only a proposal and
never changes the answer, but how fast an answer comes tells how much of it
was drafted, so an index shared by two users leaks one's text to the other by
timing. The scope says who shares:

    request   nobody: a fresh index per request, dropped when it ends
    key       the requests that send the same API key (`Authorization: Bearer KEY`);
              a request without a key gets its own index (request scope). The default.
    all       every request: one index, for a single-user server

A partition is named, in memory and in the file, by the sha256 hex digest of
its key (never the key itself), or "*" for scope all. The HTTP side hands the
worker only that name (`partition`).

Memory: `max_tokens` bounds the tokens of all partitions together. One
partition may use all of it (its own index evicts its least recently used
sequences); when the partitions together hold more, least recently used
partitions are dropped whole, never the one a request is using; and at most
MAX_KEY_PARTITIONS are kept.

With a `path`, the indexes are read from it at start when it exists (a file
that is not a suffix index, of another scope or another vocabulary is refused
with one sentence) and written there, atomically, by `save` (the server calls
it at shutdown). Thread-safe: the worker takes indexes, the HTTP side reads
`summary`, shutdown saves.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from typing import Dict, Optional

from ..drafters.suffix_index import (DEFAULT_SUFFIX_TOKENS, SuffixIndex, load_indexes,
                                     save_indexes)

SCOPES = ("request", "key", "all")
DEFAULT_SCOPE = "key"  # the safe default: no text crosses from one key to another
ALL = "*"  # the one partition of scope all
MAX_KEY_PARTITIONS = 64
_DIGEST = re.compile(r"[0-9a-f]{64}")


def bearer_key(authorization: Optional[str]) -> Optional[str]:
    """The KEY of an `Authorization: Bearer KEY` header; None without one."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class SuffixScopes:
    """The server's suffix indexes, one per partition of its scope (see the module docstring)."""

    def __init__(self, scope: str = DEFAULT_SCOPE, max_tokens: int = DEFAULT_SUFFIX_TOKENS,
                 path=None, vocab_size: Optional[int] = None):
        if scope not in SCOPES:
            raise ValueError(f"The suffix scope must be one of {', '.join(SCOPES)}, got {scope!r}.")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"The suffix index budget must be an int >= 1, got {max_tokens!r}.")
        if path is not None and scope == "request":
            raise ValueError("A suffix index file keeps shared indexes; with scope request "
                             "nothing is shared, so there is nothing to keep.")
        self.scope, self.max_tokens, self.vocab_size = scope, max_tokens, None
        self.path = None if path is None else os.fspath(path)
        self._indexes: "OrderedDict[str, SuffixIndex]" = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        if self.path is not None:
            folder = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(folder):
                raise ValueError(f"The folder of the suffix index file, {folder}, does not exist.")
            if os.path.exists(self.path):
                self._load()
        if vocab_size is not None:
            self.check_vocabulary(vocab_size)

    def check_vocabulary(self, vocab_size: int) -> None:
        """The served model's vocabulary: a loaded index of another is refused (one sentence)."""
        with self._lock:
            for index in self._indexes.values():
                if index.vocab_size is not None and index.vocab_size != vocab_size:
                    raise ValueError(f"{self.path} holds tokens of a vocabulary of "
                                     f"{index.vocab_size}; the model's has {vocab_size}: keep "
                                     f"one suffix index file per model.")
            self.vocab_size = vocab_size

    def partition(self, authorization: Optional[str]) -> Optional[str]:
        """The partition of a request with this Authorization header (None: its own index)."""
        if self.scope == "all":
            return ALL
        key = bearer_key(authorization) if self.scope == "key" else None
        return None if key is None else hashlib.sha256(key.encode()).hexdigest()

    def index_for(self, partition: Optional[str]) -> SuffixIndex:
        """The index a request of `partition` drafts from (and joins)."""
        if partition is None:
            return SuffixIndex(self.max_tokens, self.vocab_size)
        with self._lock:
            index = self._indexes.get(partition)
            if index is None:
                index = self._indexes[partition] = SuffixIndex(self.max_tokens, self.vocab_size)
            self._indexes.move_to_end(partition)
            self._trim(keep=partition)
            return index

    def peek(self, partition: Optional[str]) -> Optional[SuffixIndex]:
        """The partition's index if one is held, without making it recently used."""
        with self._lock:
            return self._indexes.get(partition)

    def summary(self) -> dict:
        """What /health reports: the scope, partitions held, tokens held and the budget."""
        with self._lock:
            indexes = list(self._indexes.values())
        return {"scope": self.scope, "partitions": len(indexes),
                "tokens": sum(len(index) for index in indexes), "max_tokens": self.max_tokens}

    def save(self) -> bool:
        """Write the partitions to the file (atomically); False when there is no file."""
        if self.path is None:
            return False
        with self._lock:
            self._trim(keep=None)
            indexes = dict(self._indexes)
        save_indexes(self.path, indexes)
        return True

    # --- inside ---
    def _load(self) -> None:
        indexes = load_indexes(self.path)
        if self.scope == "all" and list(indexes) == [""]:  # one index, saved with SuffixIndex.save
            indexes = {ALL: indexes[""]}
        names = list(indexes)
        ours = names == [ALL] if self.scope == "all" else all(_DIGEST.fullmatch(n) for n in names)
        if names and not ours:
            other = "key" if self.scope == "all" else "all"
            raise ValueError(f"{self.path} holds suffix indexes of another scope (--suffix-scope "
                             f"{other}); start with that scope or give another file.")
        for index in indexes.values():
            index.max_tokens = self.max_tokens  # this run's budget (evicts from its next add)
        self._indexes.update(indexes)
        self._trim(keep=None)

    def _trim(self, keep: Optional[str]) -> None:
        """Drop least recently used partitions beyond the count or the budget, never `keep`
        (by default the most recently used one: a budget smaller than one partition is its
        own index's to keep)."""
        if keep is None and self._indexes:
            keep = next(reversed(self._indexes))
        held: Dict[str, int] = {name: len(index) for name, index in self._indexes.items()}
        total = sum(held.values())
        for name in list(self._indexes):
            if total <= self.max_tokens and len(self._indexes) <= MAX_KEY_PARTITIONS:
                return
            if name != keep:
                total -= held[name]
                del self._indexes[name]
