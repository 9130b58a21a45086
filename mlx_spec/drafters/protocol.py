"""The drafter protocol and the `Proposal` every drafter returns (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx


@dataclass
class Proposal:
    tokens: mx.array  # (k,) uint32, lazy
    probs: Optional[mx.array]  # (k, V) q, probabilities; None when decoding greedily
    source: str  # "draft", "lookup", "suffix", "mtp" or "dflash": where accepted tokens came from
    drafter: object  # the drafter to commit() after verification
    # A draft of another tokenizer: how the proposal crossed ("string" or "intersection")
    cross_rule: Optional[str] = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


def point_masses(tokens: mx.array, vocab_size: int) -> mx.array:
    """q of deterministic drafts (k,): one-hot on each, (k, V) float32."""
    return (mx.arange(vocab_size)[None] == tokens[:, None]).astype(mx.float32)


def point_mass_proposal(found: List[int], vocab_size: int, greedy: bool, source: str,
                        drafter) -> Proposal:
    """A deterministic drafter's proposal (prompt lookup, suffix drafting): q is one-hot on
    each proposed token, so the exact acceptance rule applies unchanged."""
    tokens = mx.array(found, mx.uint32)  # (k,)
    return Proposal(tokens, None if greedy else point_masses(tokens, vocab_size), source,
                    drafter)


class TextSearchDrafter:
    """A drafter that searches token ids on the host (prompt lookup, suffix drafting): its
    `lookup(history, k)` gives the tokens, proposed as a point mass; nothing to rewind."""

    source: str
    target_vocab_size: int
    greedy: bool

    def lookup(self, history: List[int], k: int) -> List[int]:
        raise NotImplementedError

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        found = self.lookup(history, k)
        if not found:
            return None
        return point_mass_proposal(found, self.target_vocab_size, self.greedy, self.source, self)

    def commit(self, num_accepted: int) -> None:
        pass  # accepted tokens reach the search through the shared history
