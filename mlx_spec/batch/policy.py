"""How many drafts a batch verifies per row: the policy's model (policy.py) for B rows.

For B rows drafting k each (k = 0: plain batched decoding)

    rate_B(k) = B E(a, k) / T_B(k),      E(a, k) = (1 - a^(k+1)) / (1 - a),  E(a, 0) = 1

- a, the rows' per-draft acceptance: each drafting round's tokens per row read through
  E(a, k) (the i.i.d. model: the a that explains them), decayed, shrunk to the
  single-stream prior (policy.DEFAULT_ACCEPTANCE_PRIOR) by policy.PRIOR_ACCEPTANCE_ROUNDS.
- T_B(k), the seconds of a round of B rows at k: per batch size the same decayed, shrunk
  least-squares line a drafting source has (policy.SourceEstimate), k = 0 included; its
  prior the nearest measured batch size's line (none for the first: then proportional to
  k + 1 until two k are timed).

Each round runs k* = argmax over 0..max_k. Exploration is explicit and bounded: a batch size
seen for the first time runs FIRST_K (or the nearest size's k*) for TRIAL_ROUNDS rounds, then
plain decoding for as many (two points of its line; the two are usually far apart); then
every `every` rounds it tries k* - 1 or k* + 1 in turn for TRIAL_ROUNDS rounds, unless even
with every draft kept (a = 1) that k could not beat k* there, or at a smaller batch size
whose rounds ran both (more rows are only more compute-bound); a trial that does not move k*
doubles `every` (EXPLORE_EVERY up to MAX_EXPLORE_EVERY), one that does resets it. A pinned
k is never changed. Exactness never depends on k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..costmodel import expected_tokens_per_round
from ..policy import (DEFAULT_ACCEPTANCE_PRIOR, DEFAULT_DECAY, PRIOR_ACCEPTANCE_ROUNDS,
                      SourceEstimate)

FIRST_K = 2
TRIAL_ROUNDS = 2
EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 128


def acceptance_from_tokens(tokens_per_row: float, k: int) -> float:
    """The a with E(a, k) = tokens_per_row (clipped to [0, 1])."""
    if tokens_per_row >= k + 1:
        return 1.0
    if tokens_per_row <= 1.0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if expected_tokens_per_round(mid, k) < tokens_per_row:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass
class _Size:
    """One batch size: its cost line, where it stands, and its exploration."""

    line: SourceEstimate
    prior: Optional[tuple]  # the nearest size's line when it was first seen
    schedule: List[int] = field(default_factory=list)  # ks still to run before the model
    chosen: int = 0
    since: int = 0  # rounds since the last trial
    every: int = EXPLORE_EVERY
    direction: int = -1
    trial: Optional[int] = None  # the k on trial, and how many of its rounds are left
    trial_left: int = 0
    timed: set = field(default_factory=set)  # the ks its rounds ran


class BatchPolicy:
    def __init__(self, max_k: int, fixed: Optional[int] = None, decay: float = DEFAULT_DECAY,
                 acceptance_prior: float = DEFAULT_ACCEPTANCE_PRIOR):
        if fixed is not None and fixed < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {fixed}.")
        if max_k < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_k}.")
        self.max_k, self.fixed, self.decay = max_k, fixed, decay
        self.accepted = acceptance_prior * PRIOR_ACCEPTANCE_ROUNDS  # decayed a-weighted rounds
        self.weight = PRIOR_ACCEPTANCE_ROUNDS
        self._sizes: Dict[int, _Size] = {}

    @property
    def acceptance(self) -> float:
        return self.accepted / self.weight

    # --- the model ---
    def rate(self, batch: int, k: int, acceptance: Optional[float] = None) -> Optional[float]:
        """rate_B(k): tokens a second of B rows drafting k (None while unknown)."""
        size = self._size(batch)
        seconds = size.line.seconds(k, size.prior)
        if not seconds:
            return None
        a = self.acceptance if acceptance is None else acceptance
        return batch * (expected_tokens_per_round(a, k) if k else 1.0) / seconds

    def best(self, batch: int) -> int:
        rates = {k: self.rate(batch, k) for k in range(self.max_k + 1)}
        known = {k: r for k, r in rates.items() if r is not None}
        return max(known, key=known.get) if known else self._size(batch).chosen

    # --- the protocol the engine calls ---
    def choose(self, batch: int) -> int:
        if self.fixed is not None:
            return self.fixed
        size = self._size(batch)
        if size.schedule:
            return size.schedule[0]
        if size.trial is not None:
            return size.trial
        size.chosen = self.best(batch)
        if size.since >= size.every:
            size.since = 0
            for step in (size.direction, -size.direction):
                k = size.chosen + step
                if 0 <= k <= self.max_k and not self._hopeless(batch, k, size.chosen):
                    size.direction = -step
                    size.trial, size.trial_left = k, TRIAL_ROUNDS
                    return k
        return size.chosen

    def observe(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        if self.fixed is not None or seconds <= 0:
            return
        size = self._size(batch)
        size.line.add(k, seconds)
        size.timed.add(k)
        if k:
            self.accepted = self.decay * self.accepted + acceptance_from_tokens(tokens / batch, k)
            self.weight = self.decay * self.weight + 1.0
        if size.schedule:
            size.schedule.pop(0)
            return
        if size.trial is None:
            size.since += 1
            return
        size.trial_left -= 1
        if size.trial_left == 0:
            moved = self.best(batch) == size.trial
            size.trial = None
            size.every = EXPLORE_EVERY if moved else min(2 * size.every, MAX_EXPLORE_EVERY)

    def _hopeless(self, batch: int, k: int, chosen: int) -> bool:
        """Whether k could not beat the chosen k even with every draft kept: at this batch
        size, or at a smaller one whose rounds ran both (more rows only make the verify pass
        more compute-bound, so one trial there settles it for every larger batch)."""
        for b, size in self._sizes.items():
            here = b == batch
            if b > batch or not (here or {k, size.chosen} <= size.timed):
                continue
            best, hopeful = self.rate(b, size.chosen if not here else chosen), \
                self.rate(b, k, acceptance=1.0)
            if best is not None and hopeful is not None and hopeful < best:
                return True
        return False

    def _size(self, batch: int) -> _Size:
        """A batch size seen for the first time: the nearest measured one's line as its prior
        and its k* to start from (the very first: FIRST_K), then plain rounds."""
        if batch not in self._sizes:
            start, prior = min(FIRST_K, self.max_k), None
            if self._sizes:
                near = min(self._sizes, key=lambda b: abs(b - batch))
                start = self._sizes[near].chosen
                line = self._sizes[near].line
                zero, one = line.seconds(0, self._sizes[near].prior), line.seconds(
                    1, self._sizes[near].prior)
                if zero is not None and one is not None:
                    prior = (zero, one - zero)
            schedule = [start] * TRIAL_ROUNDS + ([0] * TRIAL_ROUNDS if start else [])
            self._sizes[batch] = _Size(SourceEstimate(self.max_k, 0.0, self.decay, False, False),
                                       prior, schedule, chosen=start)
        return self._sizes[batch]

    def describe(self) -> dict:
        return {"policy": "batch", "fixed": self.fixed, "acceptance": round(self.acceptance, 3),
                "chosen": {b: size.chosen for b, size in self._sizes.items()}}
