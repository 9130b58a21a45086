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

from typing import Dict, Optional

DECAY = 0.7  # weight of the past in each rate
EXPLORE_EVERY = 8  # rounds at the chosen k between two trials of a neighbour
MAX_EXPLORE_EVERY = 128
TRIAL_ROUNDS = 2
MARGIN = 0.03
FIRST_K = 2
FIRST_TRIAL_AFTER = 2


class BatchPolicy:
    def __init__(self, max_k: int, drafting: bool, fixed: Optional[int] = None):
        if fixed is not None and fixed < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {fixed}.")
        if max_k < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_k}.")
        self.max_k, self.drafting, self.fixed = max_k, drafting, fixed
        self._chosen: Dict[int, int] = {}  # batch size -> k
        self._rates: Dict[int, Dict[int, float]] = {}  # batch size -> k -> tokens/s
        self._since: Dict[int, int] = {}  # rounds at the chosen k since the last trial
        self._trial: Dict[int, tuple] = {}  # batch size -> (k on trial, rounds left)
        self._direction: Dict[int, int] = {}
        self._first: Dict[int, int] = {}  # batch size -> the k its first trial runs
        self._every: Dict[int, int] = {}  # batch size -> rounds between trials now
        self._seconds: Dict[int, Dict[int, float]] = {}  # batch size -> k -> seconds per round

    def choose(self, batch: int) -> int:
        if self.fixed is not None or not self.drafting:
            return self.fixed if self.fixed is not None else 0
        if batch not in self._chosen:
            self._chosen[batch] = self._start(batch)
            if self._chosen[batch]:  # drafting: try plain decoding soon
                self._first[batch] = 0
        chosen = self._chosen[batch]
        trial = self._trial.get(batch)
        if trial is not None:
            return trial[0]
        if batch in self._first and self._since.get(batch, 0) >= FIRST_TRIAL_AFTER:
            self._since[batch] = 0
            self._trial[batch] = (self._first.pop(batch), TRIAL_ROUNDS)
            return self._trial[batch][0]
        if self._since.get(batch, 0) >= self._every.get(batch, EXPLORE_EVERY):
            direction = self._direction.get(batch, -1)
            neighbour = chosen + direction
            if not 0 <= neighbour <= self.max_k:
                direction, neighbour = -direction, chosen - direction
            self._direction[batch] = -direction
            self._since[batch] = 0
            if self._hopeless(batch, neighbour):
                return chosen
            self._trial[batch] = (neighbour, TRIAL_ROUNDS)
            return neighbour
        return chosen

    def _hopeless(self, batch: int, k: int) -> bool:
        """Even with every draft kept, k's rounds (as timed) would emit fewer tokens per second
        than the chosen k does, at this batch size or a smaller one (more rows only make the
        verify pass more compute-bound)."""
        for b, times in self._seconds.items():
            seconds = times.get(k)
            best = self._rates.get(b, {}).get(self._chosen.get(b))
            if b <= batch and seconds is not None and best is not None \
                    and b * (k + 1) / seconds < best:
                return True
        return False

    def _start(self, batch: int) -> int:
        """A new batch size starts where the nearest measured one is (else FIRST_K)."""
        if not self._chosen:
            return min(FIRST_K, self.max_k)
        nearest = min(self._chosen, key=lambda b: abs(b - batch))
        return self._chosen[nearest]

    def observe(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        if self.fixed is not None or not self.drafting or seconds <= 0:
            return
        rates = self._rates.setdefault(batch, {})
        rate = tokens / seconds
        rates[k] = rate if k not in rates else DECAY * rates[k] + (1 - DECAY) * rate
        times = self._seconds.setdefault(batch, {})
        times[k] = seconds if k not in times else DECAY * times[k] + (1 - DECAY) * seconds
        trial = self._trial.get(batch)
        if trial is not None and trial[0] == k:
            left = trial[1] - 1
            if left > 0:
                self._trial[batch] = (k, left)
                return
            del self._trial[batch]
            chosen = self._chosen[batch]
            if rates[k] > rates.get(chosen, 0.0) * (1 + MARGIN):
                self._chosen[batch] = k
                self._every[batch] = EXPLORE_EVERY
            else:
                self._every[batch] = min(2 * self._every.get(batch, EXPLORE_EVERY),
                                         MAX_EXPLORE_EVERY)
            return
        self._since[batch] = self._since.get(batch, 0) + 1

    def describe(self) -> dict:
        return {"policy": "batch", "fixed": self.fixed, "chosen": dict(self._chosen),
                "rates": {b: {k: round(r, 1) for k, r in rates.items()}
                          for b, rates in self._rates.items()}}
