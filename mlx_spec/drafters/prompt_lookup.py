"""Proposals by n-gram lookup: continue the latest earlier occurrence of the last n tokens.

No model at all: the history (prompt + generated text, after the earlier turns
a reused prompt cache holds when the call that left it recorded them) is searched for the
most recent earlier occurrence of its last n tokens, longest n first, and the
tokens that followed it are proposed (repeating with the match's period when
they run into the end of the text). A deterministic proposal is a one-hot q,
so the exact acceptance rule applies unchanged.

How many of those tokens is the match's track record: a 32-token guess after a
one-token match is a lottery ticket. An alignment (how far back its source
lies) proposes at most LENGTH_PER_MATCHED_TOKEN tokens per token it matches
backwards, plus every token accepted along it before (a copy that resumes
after a one-token edit keeps its credit); once two of its proposals in a row
were cut short, at most SHORT_LOOKUP_TOKENS, doubling with each proposal
accepted in full. The policy's k is the ceiling. Lengths never change the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..defaults import DEFAULT_MAX_NGRAM  # one place for the CLI and the API
from .protocol import TextSearchDrafter

DEFAULT_MIN_NGRAM = 1
PAIRED_MIN_NGRAM = 2  # when a draft model is asked next
LENGTH_PER_MATCHED_TOKEN = 2  # a fresh alignment proposes this many tokens per matched token
SHORT_LOOKUP_TOKENS = 2  # an alignment cut short twice in a row proposes this many, doubling
FAILURES_BEFORE_SHORT = 2  # proposals in a row cut short that make an alignment short


def on_by_default(model_behind: bool, greedy: bool, seeded: bool = False) -> bool:
    """Prompt lookup's default (`prompt_lookup=None`): on for every target at every temperature,
    except in front of a paid drafter (a draft model, an MTP head, a block drafter) at T > 0,
    and in a `seeded` sampled run (stream_generate with a seed, a batch row with one), whose k
    is fixed so that the seed repeats the text: lookup alone would then draft at every match
    with no off switch, and lose at every one where verifying costs a plain step per token (a
    quantized model on a CPU).

    Alone, lookup competes only with plain steps: a round with no match is a plain step (the
    host search is a few dict lookups), and the policy switches lookup off while it loses. In
    front of a drafter at T > 0 its point mass, kept with chance p(x), is asked first and takes
    rounds from the drafter's closer q: measured on 8 pairs at T = 0.7 / 1 it helped only where
    lookup alone was the best setting and cost up to 10% elsewhere (shipped-f16 at T = 0.7:
    1.23x -> 1.11x plain; docs/drafting.md, "Prompt lookup"). There `assemble` puts it behind
    the drafter instead, as the adaptive policy's fallback (`policy.fall_back`).
    """
    return greedy or not (model_behind or seeded)


def behind_by_default(model_behind: bool, greedy: bool, seeded: bool = False) -> bool:
    """Where `on_by_default` leaves it off in front of a paid drafter at T > 0, prompt lookup
    (`prompt_lookup=None`) stands behind it instead: the adaptive policy's fallback, asked only
    while the drafter sits out (policy.fall_back). Not in a seeded run (its k is fixed)."""
    return model_behind and not greedy and not seeded


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


def _matched(text: List[int], end: int, limit: int) -> int:
    """How many tokens before `end` equal the text's last ones (up to `limit`)."""
    n = 0
    while n < limit and n < end and text[end - 1 - n] == text[-1 - n]:
        n += 1
    return n


@dataclass
class Alignment:
    """The record of the proposals copied from one distance back."""

    accepted: int = 0  # tokens accepted along it, in all
    failures: int = 0  # proposals in a row not accepted in full
    limit: Optional[int] = None  # its longest proposal while on probation (None: none)

    def length(self, matched: int, k: int) -> int:
        earned = LENGTH_PER_MATCHED_TOKEN * matched + self.accepted
        if self.limit is not None:
            earned = min(earned, self.limit)
        return max(1, min(k, earned))

    def commit(self, proposed: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        if num_accepted >= proposed:
            self.failures = 0
            if self.limit is not None:
                self.limit *= 2  # long again after a few full acceptances in a row
        else:
            self.failures += 1
            if self.failures >= FAILURES_BEFORE_SHORT:
                self.limit = max(SHORT_LOOKUP_TOKENS, num_accepted + 1)


class PromptLookupDrafter(TextSearchDrafter):
    source = "lookup"
    track_record = True  # False: every proposal as long as k allows (for comparisons)

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
        self._alignments: Dict[int, Alignment] = {}  # distance back to the source -> record
        self._last: Optional[Tuple[Alignment, int]] = None  # the latest lookup's, and its length

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
                if self.track_record:
                    alignment = self._alignments.setdefault(len(text) - end, Alignment())
                    limit = -(-k // LENGTH_PER_MATCHED_TOKEN)  # enough to allow k
                    k = alignment.length(_matched(text, end, limit), k)
                    self._last = (alignment, k)
                return _continue(text[end:end + k], k)
        self._last = None
        return []

    def commit(self, num_accepted: int) -> None:
        """Credit the alignment the round's proposal came from (its lookup was the latest)."""
        if self._last is not None:
            alignment, proposed = self._last
            alignment.commit(proposed, num_accepted)
            self._last = None

    def can_propose(self, history: List[int]) -> bool:
        return bool(self.lookup(history, 1))
