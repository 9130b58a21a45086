"""An EAGLE-3 head drafting for every row of a batch: the MTP head's batching, fused taps in.

An EAGLE-3 head reads pairs as the MTP head does (drafters/eagle3.py): the target's state at
position i with the token after it, then its own output with the token it drafted. Only the
state differs: the target's taps at three layers, fused by the head's `fc`. So the batch runs
it through `BatchMTP` (batch/mtp.py) unchanged, with `Eagle3Pairs` in the MTP head's place:
the verify pass's `capture` returns the fused taps as the hidden states BatchMTP reads, and
the head's embedding, decoder layer and output over the target's vocabulary (-inf outside
the draft vocabulary) stand in for the MTP block's.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx

from ..dflash.taps import decoder_layers, embedding
from ..eagle3.model import Eagle3Head
from .dflash import batch_taps
from .mtp import BatchMTP


class Eagle3Pairs:
    """The head with the MTP head's interface (mtp/heads.py `MTPHead`) for BatchMTP."""

    def __init__(self, head: Eagle3Head, target_model):
        self.head = head
        self.embed = head.embed_tokens if "embed_tokens" in head else embedding(target_model)
        self.dtype = head.fc.weight.dtype  # (a quantized or half-precision target embedding)
        layers = head.eagle3_config.tap_layers(len(decoder_layers(target_model)))
        self._taps = batch_taps(target_model, layers)

    def capture(self, x: mx.array, cache) -> Tuple[mx.array, mx.array]:
        """(x (B, T), cache) -> (the target's logits, the fused taps (B, T, H)), one forward."""
        logits, taps = self._taps(x, cache)
        return logits, self.head.fuse(taps.astype(self.dtype))

    def __call__(self, tokens: mx.array, hidden: mx.array, cache) -> mx.array:
        """Pairs of one row: tokens (T,), fused taps (T, H) -> outputs (T, H)."""
        return self.head(self.embed(tokens), hidden, cache)

    def block(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        """(B, P, H) embeddings and hidden states (fused taps or its own outputs) -> (B, P, H)."""
        return self.head.midlayer(embeds.astype(self.dtype), hidden.astype(self.dtype), cache)

    def logits(self, g: mx.array) -> mx.array:
        return self.head.logits(g)

    def make_cache(self) -> list:
        return self.head.make_cache()


def batch_eagle3(head: Eagle3Head, target_model) -> BatchMTP:
    """The batch drafter for an EAGLE-3 head (source "eagle3"); its `head.capture` is the
    target's forward that keeps the fused taps."""
    return BatchMTP(Eagle3Pairs(head, target_model), source="eagle3")
