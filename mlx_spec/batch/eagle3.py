"""An EAGLE-3 head drafting for every row of a batch: the MTP head's batching, fused taps in.

An EAGLE-3 head reads pairs as the MTP head does (drafters/eagle3.py): the target's state at
position i with the token after it, then its own output with the token it drafted. Only the
state differs: the target's taps at three layers, fused by the head's `fc`. So the batch runs
it through `BatchMTP` (batch/mtp.py) unchanged, with the head's `Eagle3Pairs` (the interface a
single row's chain uses too) in the MTP head's place; the verify pass's `capture` here returns
the fused taps as the hidden states BatchMTP reads.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx

from ..dflash.taps import decoder_layers, tap_capture
from ..drafters.eagle3 import Eagle3Pairs
from ..eagle3.model import Eagle3Head
from .mtp import BatchMTP


class BatchEagle3Pairs(Eagle3Pairs):
    """The head's pairs with the target forward that keeps the fused taps (`capture`)."""

    def __init__(self, head: Eagle3Head, target_model):
        super().__init__(head, target_model)
        layers = head.eagle3_config.tap_layers(len(decoder_layers(target_model)))
        self._taps = tap_capture(target_model, layers)

    def capture(self, x: mx.array, cache) -> Tuple[mx.array, mx.array]:
        """(x (B, T), cache) -> (the target's logits, the fused taps (B, T, H)), one forward."""
        logits, taps = self._taps(x, cache)
        return logits, self.fuse(taps)


def batch_eagle3(head: Eagle3Head, target_model) -> BatchMTP:
    """The batch drafter for an EAGLE-3 head (source "eagle3"); its `head.capture` is the
    target's forward that keeps the fused taps."""
    return BatchMTP(BatchEagle3Pairs(head, target_model), source="eagle3")
