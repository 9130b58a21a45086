"""Proposals from everything already seen: the most frequent continuation of the longest
suffix of the history found in a `SuffixIndex` (this request's text and earlier ones').

The request's history joins the index as a live sequence when the drafter is
first asked, so its own prompt and output are searched too (as prompt lookup
searches them) and, once the call ends, later requests sharing the index draft
from them. The proposal's length is capped by the match: at most
LENGTH_PER_MATCHED_TOKEN tokens per matched token (a one-token match is a weak
signal, a 40-token one a strong one), and by the policy's k, which follows the
source's observed acceptance. A proposal is a point mass (one-hot q), so the
exact acceptance rule applies unchanged at any temperature. `lookup_paths` gives
up to `width` distinct continuations of the match, the first `lookup`'s: the
paths of a token tree (drafters/tree.py).

`default_suffix_index()` is the process's shared index that `suffix=True`
drafts from: in one app every call sees every earlier call. The server keeps
its own, partitioned (mlx_spec/server/suffix_scope.py).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import List, Optional

from .protocol import TextSearchDrafter
from .suffix_index import ANCHOR, DEFAULT_MIN_SHARE, SuffixIndex

LENGTH_PER_MATCHED_TOKEN = 2  # a proposal runs at most this many tokens per matched token
PAIRED_MIN_MATCH = 3  # the shortest match worth proposing in front of a model drafter
# In front of prompt lookup a match must reach the index's long anchor: shorter matches are
# lookup's (its most recent occurrence proposed up to the policy's k drafted more per pass on
# text with nothing to reuse: bench/results/suffix-traces-*, trace "fresh").
BEFORE_LOOKUP_MIN_MATCH = ANCHOR


def suffix_min_match(lookup_behind: bool, model_behind: bool) -> int:
    """The shortest match suffix drafting proposes from, given what is asked after it."""
    if lookup_behind:
        return BEFORE_LOOKUP_MIN_MATCH
    return PAIRED_MIN_MATCH if model_behind else 1

_default_index: Optional[SuffixIndex] = None
_default_lock = threading.Lock()


def default_suffix_index() -> SuffixIndex:
    """The process-wide index `suffix=True` uses (created on first use)."""
    global _default_index
    with _default_lock:
        if _default_index is None:
            _default_index = SuffixIndex()
        return _default_index


def check_vocabulary(index: SuffixIndex, target_vocab_size: int) -> None:
    """An index serves one vocabulary: the first target to draft from it sets it."""
    if index.vocab_size is None:
        index.vocab_size = target_vocab_size
    elif index.vocab_size != target_vocab_size:
        raise ValueError(f"This suffix index holds tokens of a vocabulary of {index.vocab_size}; "
                         f"the target's has {target_vocab_size}. Use one index per tokenizer.")


class SuffixDrafter(TextSearchDrafter):
    source = "suffix"

    def __init__(self, index: SuffixIndex, target_vocab_size: int, greedy: bool,
                 min_match: int = 1, min_share: float = DEFAULT_MIN_SHARE):
        check_vocabulary(index, target_vocab_size)
        self.index = index
        self.target_vocab_size = target_vocab_size
        self.greedy = greedy
        self.min_match = min_match
        self.min_share = min_share
        self._own: Optional[int] = None  # the history's id in the index, once joined
        self.last_match = 0  # the length of the last lookup's match (for reports and tests)

    def attach(self, history: List[int]) -> None:
        """The call's history (the loop's own list, which grows) joins the index before the
        first round, so the whole call's text is there even if it never drafts; it may be
        evicted again once this drafter is collected, at the end of the call."""
        self._join(history)

    def _join(self, history: List[int]) -> None:
        if self._own is None:
            self._own = self.index.add(history, live=True)
            weakref.finalize(self, self.index.release, self._own)

    def lookup(self, history: List[int], k: int) -> List[int]:
        paths = self.lookup_paths(history, k, 1)
        return paths[0] if paths else []

    def lookup_paths(self, history: List[int], k: int, width: int) -> List[List[int]]:
        """Up to `width` distinct continuations of the history's longest matched suffix, each
        up to k tokens (capped by the match): `lookup`'s first (SuffixIndex.follow_paths)."""
        self._join(history)
        match = self.index.longest(history)
        self.last_match = match.length
        if match.length < self.min_match:
            return []
        k = min(k, math.ceil(LENGTH_PER_MATCHED_TOKEN * match.length))
        return self.index.follow_paths(match, history, k, width, self.min_share)

    def can_propose(self, history: List[int]) -> bool:
        self._join(history)
        return self.index.longest(history).length >= self.min_match
