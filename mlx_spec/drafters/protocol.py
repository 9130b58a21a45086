"""The drafter protocol and the `Proposal` every drafter returns (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx


@dataclass
class Proposal:
    tokens: mx.array  # (k,) uint32, lazy
    probs: Optional[mx.array]  # (k, V) q, probabilities; None when decoding greedily
    source: str  # "draft", "lookup" or "mtp": where accepted tokens came from
    drafter: object  # the drafter to commit() after verification

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]
