"""Plain batched rounds queued back to back: the next step dispatched before this one is read.

A round where no row drafts (the policy chose plain decoding, no row's host search proposed)
is one target step for every row. As the loop's `plain_rounds`, the engine dispatches the step
after it on this step's lazy tokens (`mx.async_eval`) before reading them, so the host's work
on one step overlaps the device's on the next. A dispatched step is always read: a block ends
one step later than it could (as the loop's); a row that ended or left meanwhile drops its
queued token with its cache.

Each row is judged as verify.py judges a round of no drafts (`chain_parts`: greedy, the
argmax; sampled, a draw with the row's own key, or its opaque sampler's), so a row's text
and random stream do not depend on whether its rounds were queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx

from ..judge import verdict_size
from .kv import BatchCache
from .rows import Row
from .verify import ACCEPT, Verdict, chain_parts, read_chain


@dataclass
class Step:
    """One dispatched plain step: the rows it was for (in the batch's order then), every
    row's verdict parts in one lazy array, each row's logits (1, V), lazy, and the target's
    hidden states (B, 1, .) where a head reads them (the next step's forward replaces the
    cache's own before this one is read)."""

    rows: List[Row]
    parts: mx.array
    logits: List[mx.array]
    hidden: Optional[mx.array] = None

    def states(self, rows: Sequence[Row]) -> Optional[mx.array]:
        """(B, 1, .) the target's hidden states of `rows` (the step's rows still in the batch,
        in the batch's order now), lazy; None where no head reads them."""
        if self.hidden is None:
            return None
        at = {row.uid: i for i, row in enumerate(self.rows)}
        return self.hidden[mx.array([at[row.uid] for row in rows])]

    def tokens(self, rows: Sequence[Row]) -> mx.array:
        """(B, 1) uint32, lazy: the token of each of `rows` (the step's rows still in the
        batch; the verdict's: greedy [token], sampled [0, token]), the next step's input."""
        at, picked = 0, {}
        for row in self.rows:
            picked[row.uid] = self.parts[at + (0 if row.greedy else 1)]
            at += verdict_size(0, row.greedy)
        return mx.stack([picked[row.uid] for row in rows])[:, None]


def dispatch(target: BatchCache, rows: Sequence[Row], inputs: mx.array, accept=ACCEPT,
             queued: bool = False) -> Step:
    """The target's step over `inputs` (B, 1), each row judged alone, evaluated
    asynchronously: the cache holds the step's position from now on. `queued`: the inputs
    are the step before's lazy tokens, not yet in the rows' histories (a row's logits
    processors see them lazily, as the loop's plain steps hand them over)."""
    logits = target.forward(inputs, undoable=False)  # (B, 1, V): every row keeps it
    parts, row_logits = [], []
    for i, row in enumerate(rows):
        row_parts, row_logit = chain_parts(row, None, logits[i, :1], accept,
                                           unread=inputs[i] if queued else None)
        parts.append(row_parts)
        row_logits.append(row_logit)
    step = Step(list(rows), mx.concatenate(parts), row_logits, target.hidden)
    mx.async_eval(step.parts)
    return step


def read(step: Step, rows: Sequence[Row]) -> List[Verdict]:
    """The verdicts of `rows` (those of the step's rows still in the batch, in its order)
    from the step's values: the round's one sync."""
    values = step.parts.tolist()
    verdicts, at = {}, 0
    for row, logits in zip(step.rows, step.logits):
        verdicts[row.uid], at = read_chain(row, 0, logits, values, at)
    return [verdicts[row.uid] for row in rows]
