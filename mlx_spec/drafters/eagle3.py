"""Proposals from an EAGLE-3 head: it drafts from three tapped target layers, fused.

The loop hands it the target's taps (low, mid, high layer outputs side by side) at every
position the target keeps, with the token after each (`follow`: prefill chunks, the kept rows
of a verify pass, plain steps); they are queued and fed in one pass at the next proposal: the
pair (h_i, x_{i+1}) enters as fc(h_i) with the embedding of x_{i+1}. The head's output at the
last pair drafts d1; each further draft feeds the head's own pre-norm output back, with the
embedding of the token just drafted (no fc: EAGLE's cnets.py, vLLM, SGLang).

The queue, the chain and its cache are head_chain.py's (one entry per pair; `commit` trims
the chained steps' entries, the accepted positions come back through `follow`).

q for the acceptance rule: the head's logits over the draft vocabulary placed at their target
ids (draft id d is target id d + d2t[d]), -inf elsewhere, then the target's own sampling
transform: q is zero outside the draft vocabulary, and the residual max(p - q, 0) covers the
target's whole vocabulary (acceptance.py).
"""

from __future__ import annotations

import mlx.core as mx

from ..dflash.taps import embedding
from ..eagle3.model import Eagle3Head
from ..sampling import SamplingConfig
from .head_chain import HeadChainDrafter


class Eagle3Pairs:
    """An EAGLE-3 head with the MTP head's interface (mtp/heads.py `MTPHead`), for the chain of
    head_chain.py, one row or a batch: a token enters as its embedding (the head's own, else
    the target's); the head casts what enters to its dtype (a quantized or half-precision
    target); `fuse` turns the target's taps into the states it reads."""

    def __init__(self, head: Eagle3Head, target_model):
        self.head = head
        self.embed = head.embed_tokens if "embed_tokens" in head else embedding(target_model)
        self.fuse = head.fuse  # the target's taps (..., 3 * H_target) -> the states it reads
        self.block = head  # (B, P, H) embeddings and states -> (B, P, H), in its dtype
        self.logits, self.make_cache = head.logits, head.make_cache


class Eagle3Drafter(HeadChainDrafter):
    """The chain of head_chain.py over `Eagle3Pairs`, the target's taps fused on the way in."""

    source = "eagle3"

    def __init__(self, head: Eagle3Head, target_model, sampling: SamplingConfig):
        super().__init__(Eagle3Pairs(head, target_model), sampling)

    def states(self, hidden: mx.array) -> mx.array:
        """The taps (m, 3 * H_target), fused: (m, H)."""
        return self.head.fuse(hidden)
