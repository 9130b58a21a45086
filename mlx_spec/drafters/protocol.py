"""The drafter protocol and the `Proposal` every drafter returns (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..tree import along, widest


@dataclass
class Proposal:
    """One round's drafts for one sequence (a call of its own, or a batch's row): a chain, or a
    token tree (`parents`: drafters/tree.py, batch/trees.py)."""

    tokens: mx.array  # (k,) uint32, lazy; a tree's nodes 1..N-1 (node 0: the last history token)
    probs: Optional[mx.array]  # (k, V) q, probabilities; None when decoding greedily
    source: str  # "draft", "lookup", "suffix", "mtp" or "dflash": where accepted tokens came from
    drafter: object = None  # the drafter to commit() after verification (None: nothing to tell)
    # A draft of another tokenizer: how the proposal crossed ("string" or "intersection")
    cross_rule: Optional[str] = None
    parents: Optional[Tuple[int, ...]] = None  # a tree's (N,), parents[0] == -1; None: a chain
    spine: Tuple[int, ...] = ()  # ... the base drafter's own chain in it, as node ids

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """The most children a node of its tree has (1: a chain)."""
        return 1 if self.parents is None else widest(self.parents)

    def along_spine(self, path: Sequence[int]) -> int:
        """How many of the accepted `path`'s nodes (a tree's) are the spine's first ones."""
        return along(path, self.spine)


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
