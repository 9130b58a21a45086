"""k drafts, each fed back to draft the next: the loop every chaining drafter runs.

A draft model (one row: draft_model.py; a batch's rows: batch/drafts.py) and a head on
the target's states (MTP, EAGLE-3: head_chain.py, one row and batched) draft the same way:

    draft 1 = draw(logits at the last token seen)
    draft i + 1 = draw(step(draft i))

What differs is only how a draft is fed (`step`: the draft model's next position, or the
head on its own last output) and drawn (`draw`: one row's sampler, or each batch row's own
sampling and random key), so the loop lives here once.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import mlx.core as mx


def draft_chain(logits: mx.array, k: int, step: Callable[[mx.array], mx.array],
                draw: Callable[[mx.array, int], mx.array],
                more: Optional[Callable[[int], bool]] = None) -> List[mx.array]:
    """Up to k drafts, lazy: draft i is `draw(logits, i)` (ids, queued by `draw`); each but the
    last is fed back by `step(ids) -> the next logits`. `more(i)` false after draft i (a
    confidence stop) ends the chain there, that draft not fed."""
    drafts = []
    for i in range(k):
        y = draw(logits, i)
        drafts.append(y)
        if i + 1 == k or (more is not None and not more(i)):
            break
        logits = step(y)
    return drafts
