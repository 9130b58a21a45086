"""The target's states waiting for a drafter that reads them (MTP and EAGLE-3 heads, DFlash).

Such a drafter is handed the target's hidden states (or taps) at the positions each round
kept; they wait, in blocks, until its next proposal feeds them in one pass: one sequence's
blocks joined into one (`joined`), a batch's rows' blocks right-padded into one
(`right_padded`; the batch then rolls each row into place, kv.BatchCache.align).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx


def joined(blocks: Sequence[mx.array]) -> Optional[mx.array]:
    """Waiting blocks (n_i, H) as one (sum n_i, H), lazy; None when there are none."""
    if not blocks:
        return None
    return blocks[0] if len(blocks) == 1 else mx.concatenate(list(blocks))


def right_padded(blocks: Sequence[Optional[mx.array]]) -> Tuple[mx.array, List[int]]:
    """Each row's waiting block (n_i, H), or None, as (B, max n_i, H) with zeros after a row's
    own (filler its mask or alignment drops), and the n_i. At least one block is not None."""
    lengths = [0 if b is None else b.shape[0] for b in blocks]
    width = max(lengths)
    some = next(b for b in blocks if b is not None)
    return mx.stack([mx.pad(b, [(0, width - b.shape[0]), (0, 0)]) if b is not None
                     else mx.zeros((width, some.shape[-1]), some.dtype)
                     for b in blocks]), lengths
