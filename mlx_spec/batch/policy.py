"""How many drafts a batch verifies per row: chosen by the batch's measured goodput.

A verify pass over B rows of k + 1 tokens costs more as B x (k + 1) grows, and
where it turns compute-bound (a CPU, a large batch) drafting stops paying for
itself. So the batch's k is measured, not assumed: for each batch size the
policy keeps a decayed rate (tokens emitted per second) for every k it has
run, stays at the best, and every EXPLORE_EVERY rounds tries a neighbour
(k - 1 and k + 1 in turn; k = 0 is plain batched decoding) for a few rounds,
moving only when the neighbour is better by MARGIN; each losing trial doubles
the wait before the next one (up to MAX_EXPLORE_EVERY), a winning one resets it.
A neighbour is not tried again when even every draft accepted could not beat
the chosen k: B x (k + 1) tokens in the seconds its rounds took, at this batch
size or a smaller one (where the verify pass is compute-bound, as on a CPU at
B = 8, one trial settles it for every larger batch too). A batch size seen for the
first time starts where the nearest one measured is (the very first at
FIRST_K) and, if that drafts, tries plain decoding after FIRST_TRIAL_AFTER
rounds: the two are usually far apart, stepping there one k at a time takes
dozens of rounds, and a trial of plain rounds is cheap. Exactness never
depends on k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

DECAY = 0.7  # weight of the past in each rate
EXPLORE_EVERY = 8  # rounds at the chosen k between two trials of a neighbour
MAX_EXPLORE_EVERY = 128
TRIAL_ROUNDS = 2
MARGIN = 0.03
FIRST_K = 2
FIRST_TRIAL_AFTER = 2


@dataclass
class _Size:
    """What the policy knows of one batch size."""

    chosen: int  # the k it runs
    first: Optional[int] = None  # the k of its first trial (plain decoding), run once
    rates: Dict[int, float] = field(default_factory=dict)  # k -> tokens/s, decayed
    seconds: Dict[int, float] = field(default_factory=dict)  # k -> seconds per round, decayed
    since: int = 0  # rounds at the chosen k since the last trial
    every: int = EXPLORE_EVERY  # rounds between trials now
    direction: int = -1  # where the next neighbour is tried
    trial: Optional[int] = None  # the k on trial
    trial_left: int = 0


class BatchPolicy:
    def __init__(self, max_k: int, fixed: Optional[int] = None):
        if fixed is not None and fixed < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {fixed}.")
        if max_k < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_k}.")
        self.max_k, self.fixed = max_k, fixed
        self._sizes: Dict[int, _Size] = {}

    def choose(self, batch: int) -> int:
        if self.fixed is not None:
            return self.fixed
        size = self._size(batch)
        if size.trial is not None:
            return size.trial
        if size.first is not None and size.since >= FIRST_TRIAL_AFTER:
            return self._try(size, size.first)
        if size.since >= size.every:
            neighbour = size.chosen + size.direction
            if not 0 <= neighbour <= self.max_k:
                size.direction = -size.direction
                neighbour = size.chosen + size.direction
            size.direction = -size.direction
            if self._hopeless(batch, neighbour):
                size.since = 0
                return size.chosen
            return self._try(size, neighbour)
        return size.chosen

    @staticmethod
    def _try(size: _Size, k: int) -> int:
        size.since, size.first = 0, None
        size.trial, size.trial_left = k, TRIAL_ROUNDS
        return k

    def _size(self, batch: int) -> _Size:
        """A batch size seen for the first time starts where the nearest measured one is (the
        very first at FIRST_K); if that drafts, its first trial is plain decoding."""
        if batch not in self._sizes:
            if self._sizes:
                chosen = self._sizes[min(self._sizes, key=lambda b: abs(b - batch))].chosen
            else:
                chosen = min(FIRST_K, self.max_k)
            self._sizes[batch] = _Size(chosen, first=0 if chosen else None)
        return self._sizes[batch]

    def _hopeless(self, batch: int, k: int) -> bool:
        """Even with every draft kept, k's rounds (as timed) would emit fewer tokens per second
        than the chosen k does, at this batch size or a smaller one (more rows only make the
        verify pass more compute-bound)."""
        for b, size in self._sizes.items():
            seconds, best = size.seconds.get(k), size.rates.get(size.chosen)
            if b <= batch and seconds is not None and best is not None \
                    and b * (k + 1) / seconds < best:
                return True
        return False

    def observe(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        if self.fixed is not None or seconds <= 0:
            return
        size = self._size(batch)
        for table, value in ((size.rates, tokens / seconds), (size.seconds, seconds)):
            table[k] = value if k not in table else DECAY * table[k] + (1 - DECAY) * value
        if size.trial != k:
            size.since += 1
            return
        size.trial_left -= 1
        if size.trial_left > 0:
            return
        size.trial = None
        if size.rates[k] > size.rates.get(size.chosen, 0.0) * (1 + MARGIN):
            size.chosen, size.every = k, EXPLORE_EVERY
        else:
            size.every = min(2 * size.every, MAX_EXPLORE_EVERY)

    def describe(self) -> dict:
        return {"policy": "batch", "fixed": self.fixed,
                "chosen": {b: size.chosen for b, size in self._sizes.items()},
                "rates": {b: {k: round(r, 1) for k, r in size.rates.items()}
                          for b, size in self._sizes.items()}}
