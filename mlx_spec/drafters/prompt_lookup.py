"""Proposals by n-gram lookup: continue the latest earlier occurrence of the last n tokens.

No model at all: the history (prompt + generated text, after the earlier turns
a reused prompt cache holds when the call that left it recorded them) is searched for the
most recent earlier occurrence of its last n tokens, longest n first, and the
tokens that followed it are proposed (repeating with the match's period when
they run into the end of the text). A deterministic proposal is a one-hot q,
so the exact acceptance rule applies unchanged.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ..defaults import DEFAULT_MAX_NGRAM  # one place for the CLI and the API
from .protocol import TextSearchDrafter

DEFAULT_MIN_NGRAM = 1
PAIRED_MIN_NGRAM = 2  # when a draft model is asked next


def _continue(found: List[int], k: int) -> List[int]:
    """Up to k tokens: a match that runs into the end of the history repeats with its period.

    A match P tokens back proposes the P tokens since; the text it copies
    continues with the tokens being proposed, so token j of the proposal is
    token j - P (a loop in the output, a repeated line: the common case).
    """
    period = len(found)
    while 0 < len(found) < k:
        found.append(found[len(found) - period])
    return found


class PromptLookupDrafter(TextSearchDrafter):
    source = "lookup"

    def __init__(self, target_vocab_size: int, greedy: bool,
                 max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM,
                 context: List[int] = ()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, "
                f"got min={min_ngram}, max={max_ngram}."
            )
        self.target_vocab_size = target_vocab_size
        self.greedy = greedy
        self.ngram_sizes = range(max_ngram, min_ngram - 1, -1)
        # n -> {n-gram: index just past its latest occurrence that has a continuation}
        self._index: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in self.ngram_sizes}
        self._indexed = 0  # n-grams ending before this index of `_text` are indexed
        # What is searched: `context` (earlier turns a reused prompt cache holds) + the history.
        self._context = len(context)
        self._text: List[int] = list(context)

    def _update_index(self, history: List[int]) -> List[int]:
        text = self._text  # the history only grows within a call
        text.extend(history[len(text) - self._context:])
        # Index every n-gram that ends before the last token (so it has a continuation).
        for end in range(max(self._indexed, 1), len(text)):
            for n, table in self._index.items():
                if end >= n:
                    table[tuple(text[end - n:end])] = end
        self._indexed = len(text)
        return text

    def lookup(self, history: List[int], k: int) -> List[int]:
        text = self._update_index(history)
        for n in self.ngram_sizes:
            if len(text) <= n:
                continue
            end = self._index[n].get(tuple(text[-n:]))
            if end is not None:
                return _continue(text[end:end + k], k)
        return []

    def can_propose(self, history: List[int]) -> bool:
        return bool(self.lookup(history, 1))
