"""Proposals from the target's own MTP layer: it drafts from the target's hidden states.

The MTP layer sees pairs (h_i, x_{i+1}), the target's hidden state at position i and the
token after it, and each further draft its own output with the token just drafted: the chain
of head_chain.py (queued pairs fed in one pass, chained drafts, `commit` trimming their cache
entries). Here the layer takes token ids and keeps its outputs at the prefill's pairs for the
prompt look.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ..prompt_look import Tail
from ..sampling import SamplingConfig
from .head_chain import HeadChainDrafter
from .protocol import Proposal


class MTPDrafter(HeadChainDrafter):
    """The chain of head_chain.py, the head taking token ids; it also keeps the outputs of the
    prefill's pairs for the prompt look."""

    source = "mtp"

    def __init__(self, head, sampling: SamplingConfig):
        super().__init__(head, sampling)
        self._fed: Optional[mx.array] = None  # (m, H) outputs of the last catch-up (prompt look)

    def fed(self, outputs: mx.array) -> None:
        self._fed = outputs

    def prompt_logits(self, rows: int) -> Optional[Tail]:
        """Its logits for the last r <= `rows` prompt tokens, from the prefill's last pairs, once,
        as a prompt_look.Tail (its output layer runs only over the rows the look asks for); or
        None. The output at pair (h_i, x_{i+1}) predicts x_{i+2}: the last pair's predicts the
        token after the prompt, so it is left out."""
        fed, self._fed = self._fed, None
        if fed is None or fed.shape[0] < 2:
            return None
        return Tail.through(fed[:-1], self.head.logits, rows)

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        proposal = super().propose(history, k)
        self._fed = None  # the prompt look's outputs are not wanted after a proposal
        return proposal
