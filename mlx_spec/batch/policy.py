"""How many drafts a batch verifies per row: the policy's model (policy.py) for B rows.

For B rows drafting k each (k = 0: plain batched decoding)

    rate_B(k) = sum_i E_i(w_i(k)) / T_B(k),   E_i(k) = 1 + sum_{j <= k} prod_{l <= j} a_i,l

- a_i, row i's own acceptance (per depth where it matters): the estimate a drafting source has
  in a call of its own (policy.SourceEstimate, decayed, shrunk to its prior: a calibration's
  acceptance at the row's temperature, else its sampling's guess,
  policy.DEFAULT_ACCEPTANCE_PRIOR greedy, SAMPLING_ACCEPTANCE_PRIOR sampled), counted from the
  row's own rounds. It lives on the row (`Row.acceptance`), so it is the request's: nothing of
  one request's text carries over to the next, nor to its neighbours. w_i(k) = the drafts row i
  verifies in a round of k (`Row.wants`: its pinned k, its budget).
- T_B(k), the seconds of a round of B rows at k: per batch size the same decayed, shrunk
  least-squares line a drafting source has (policy.SourceEstimate), k = 0 included; its
  prior the nearest measured batch size's line (none for the first: then proportional to
  k + 1 until two k are timed). This is what the machine measured: the policy keeps it for
  the engine's life.

Each round runs k* = argmax over 0..max_k (1..max_k with `auto_off=False`: the draft is never
switched off, as a call's `--no-auto-off`). Exploration is explicit and bounded: a batch size
seen for the first time runs FIRST_K (or the nearest size's k*) for TRIAL_ROUNDS rounds, then
plain decoding for as many (two points of its line; the two are usually far apart); then
every `every` rounds it tries k* - 1 or k* + 1 in turn for TRIAL_ROUNDS rounds, unless even
with every draft kept (a = 1) that k could not beat k* there, or at a smaller batch size
whose rounds ran both (more rows are only more compute-bound); a trial that does not move k*
doubles `every` (EXPLORE_EVERY up to MAX_EXPLORE_EVERY), one that does resets it. A pinned
k is never changed. Exactness never depends on k.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ..policy import (DEFAULT_ACCEPTANCE_PRIOR, DEFAULT_DECAY, PLAIN_BLOCK,
                      SAMPLING_ACCEPTANCE_PRIOR, SourceEstimate)

FIRST_K = 2
TRIAL_ROUNDS = 2
EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 128


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
    """k* for the rows of each round; the rows' acceptance is theirs (`Row.acceptance`,
    made by `new_estimate`), the round's cost lines the policy's."""

    def __init__(self, max_k: int, fixed: Optional[int] = None, decay: float = DEFAULT_DECAY,
                 auto_off: bool = True):
        if fixed is not None and fixed < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {fixed}.")
        if max_k < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_k}.")
        self.max_k, self.fixed, self.decay = max_k, fixed, decay
        self.min_k = 0 if auto_off else 1  # plain batched decoding is a choice, or never
        self._sizes: Dict[int, _Size] = {}
        # E per row at each k of the last rows chosen for (what another batch size's rows would
        # keep, for `_hopeless`), its ceiling (every draft kept), and their mean acceptance
        # (for reports)
        self._per_row: Callable[[int], float] = lambda k: 1.0
        self._ceiling: Callable[[int], float] = lambda k: k + 1.0
        self.acceptance: Optional[float] = None

    def new_estimate(self, greedy: bool, most: int = 0,
                     measured: Optional[float] = None) -> SourceEstimate:
        """A new request's acceptance: a calibration's for its sampling (`measured`), else its
        sampling's guess, nothing of the rows before it; deep enough for `most` drafts (a
        pinned k past max_k)."""
        guess = DEFAULT_ACCEPTANCE_PRIOR if greedy else SAMPLING_ACCEPTANCE_PRIOR
        return SourceEstimate(max(self.max_k, most), guess if measured is None else measured,
                              self.decay, False, False)

    # --- the model ---
    def rate(self, batch: int, k: int, per_row: Callable[[int], float]) -> Optional[float]:
        """rate_B(k): tokens a second of B rows drafting k, each keeping per_row(k) tokens a
        round (None while T_B(k) is unknown)."""
        size = self._size(batch)
        seconds = size.line.seconds(k, size.prior)
        return None if not seconds else batch * per_row(k) / seconds

    def best(self, batch: int) -> int:
        rates = {k: self.rate(batch, k, self._per_row) for k in range(self.min_k, self.max_k + 1)}
        known = {k: r for k, r in rates.items() if r is not None}
        return max(known, key=known.get) if known else self._size(batch).chosen

    # --- the protocol the engine calls ---
    def choose(self, rows: Sequence) -> int:
        """The k of a round of `rows` (each with `.acceptance` and `.wants(k)`)."""
        if self.fixed is not None:
            return self.fixed
        table = [statistics.fmean(row.acceptance.expected_tokens(row.wants(k)) for row in rows)
                 for k in range(self.max_k + 1)]
        ceiling = [statistics.fmean(row.wants(k) + 1.0 for row in rows)
                   for k in range(self.max_k + 1)]  # every draft kept (a pinned row's: its k)
        self._per_row, self._ceiling = table.__getitem__, ceiling.__getitem__
        self.acceptance = statistics.fmean(row.acceptance.acceptance for row in rows)
        batch = len(rows)
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
                if self.min_k <= k <= self.max_k and not self._hopeless(batch, k, size.chosen):
                    size.direction = -step
                    size.trial, size.trial_left = k, TRIAL_ROUNDS
                    return k
        return size.chosen

    def plain_steps(self, batch: int) -> int:
        """Plain rounds the engine may queue back to back (batch/plain.py) after one where no
        row proposed: PLAIN_BLOCK under a fixed k (a host search found nothing, or k = 0) or
        when the model chose plain decoding for this batch size (not a first point of its
        line, nor a trial), else 1."""
        if self.fixed is not None:
            return PLAIN_BLOCK
        size = self._size(batch)
        return PLAIN_BLOCK if not size.schedule and size.trial is None and size.chosen == 0 \
            else 1

    @staticmethod
    def count(row, output) -> None:
        """A row's round, into the row's acceptance (as a call's source counts its rounds: a
        tree's spine alone, the chain the row drafts beside others)."""
        if not output.num_drafted:
            return
        spine = getattr(output, "spine_kept", None)
        if spine is not None:
            row.acceptance.count_chain(output.spine_length or output.num_drafted, spine)
        else:
            row.acceptance.count_chain(output.num_drafted, output.num_accepted,
                                       getattr(output, "chances", None))

    def observe(self, rows: Sequence, outputs: Sequence, k: int, seconds: float) -> None:
        """A round of `rows` at k took `seconds`; `outputs`, each row's, in the same order."""
        for row, output in zip(rows, outputs):
            self.count(row, output)
        if self.fixed is not None or seconds <= 0:
            return
        size = self._size(len(rows))
        size.line.add(k, seconds)
        size.timed.add(k)
        if size.schedule:
            size.schedule.pop(0)
            return
        if size.trial is None:
            size.since += 1
            return
        size.trial_left -= 1
        if size.trial_left == 0:
            moved = self.best(len(rows)) == size.trial
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
            best = self.rate(b, size.chosen if not here else chosen, self._per_row)
            hopeful = self.rate(b, k, self._ceiling)
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
            start = max(start, self.min_k)
            plain = [0] * TRIAL_ROUNDS if start and not self.min_k else []
            schedule = [start] * TRIAL_ROUNDS + plain
            self._sizes[batch] = _Size(SourceEstimate(self.max_k, 0.0, self.decay, False, False),
                                       prior, schedule, chosen=start)
        return self._sizes[batch]

    def describe(self) -> dict:
        return {"policy": "batch", "fixed": self.fixed, "auto_off": not self.min_k,
                "acceptance": None if self.acceptance is None else round(self.acceptance, 3),
                "chosen": {b: size.chosen for b, size in self._sizes.items()}}
