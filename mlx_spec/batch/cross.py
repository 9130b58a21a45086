"""A draft of another tokenizer for a batch: one single-sequence cross-tokenizer drafter per row.

A row that joins gets its own `CrossTokenizerDrafter` (drafters/cross_tokenizer.py, the one
`generate` uses) with its own one-row draft cache, prefilled chunk by chunk beside the
target's; it is dropped with the row. The engine asks it as it asks a row's host search
(`Row.searchers`: after suffix drafting and prompt lookup), so its proposal reaches the verify
pass as a lookup row's does: its own length (verify pads a row with fewer drafts, and a row
never accepts past its own), q (k, V_target) for a sampled row and None for a greedy one, and
`commit(accepted)` after verification. Nothing else settles it: each proposal re-reads the
row's history in the draft's vocabulary and feeds what its cache has not seen, so a rejected
draft, a re-read word and the tokens a round emitted while another source proposed are all
caught up the same way (a trim of host metadata, then a feed). Both rules are the single
path's, chosen per round per row; exact at every temperature.

The draft passes of the rows run one after another, not as one batched draft pass: each row's
draft reads its own text in its own vocabulary, so the rows' catch-up lengths, positions and
step counts differ (the string rule drafts as many steps as the row's draft-to-target token
ratio asks, and reads the drafted text on the host before it can propose: one sync per row), and
how far a row's draft cache agrees with its text is known only on the host, row by row. The
draft is the small model: its steps cost little beside the one batched verify.

A sampled row draws its drafts with its own random key (`Row.next_key`), as the batched draft
model does, so a seeded row's drafts do not depend on its neighbours (the "auto" rule choice
still reads measured times, as it does for one sequence).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..assemble import draft_bridge, pair_for
from ..cache import make_cache
from ..drafters.cross_tokenizer import CrossTokenizerDrafter
from ..drafters.protocol import Proposal
from ..drafters.vocab_bridge import VocabBridge
from ..loading import vocab_size
from .rows import Row


class RowCross:
    """One row's drafter, as the engine's host searches are asked: `propose(history, k)`,
    `commit(accepted)`, `can_propose(history)` (whether it would: a plain block ends); its
    proposals say how they crossed (`Proposal.cross_rule`)."""

    source = "draft"  # to the policy it is the draft model

    def __init__(self, drafter: CrossTokenizerDrafter):
        self.drafter = drafter

    def prefill(self, prompt: List[int], step_size: int) -> None:
        self.drafter.prefill(prompt, step_size)

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        return self.drafter.propose(history, k)

    def commit(self, num_accepted: int) -> None:
        self.drafter.commit(num_accepted)

    def can_propose(self, history: List[int]) -> bool:
        return self.drafter.can_propose(history)

    def step_seconds(self, row: Row) -> float:
        """One draft step's seconds, undone (the one-row drafter's, as a call times it)."""
        return self.drafter.step_seconds(row.history[-1])

    @property
    def layers(self) -> list:
        """The draft cache's layers (the ids they hold ride on the first: a reused cache's
        next row keeps the prefix that still agrees)."""
        return self.drafter.draft.layers


class BatchCross:
    """The draft model of another tokenizer and the bridge to its vocabulary; `join` gives a
    row its own drafter."""

    drafter_class = CrossTokenizerDrafter  # (a test swaps in a broken one: its negative control)
    rule: Optional[str] = None  # None: "auto", each row's drafter choosing per round

    def __init__(self, draft_model, bridge: VocabBridge, target_vocab_size: int):
        self.draft_model, self.bridge = draft_model, bridge
        self.target_vocab_size = target_vocab_size
        self.draft_vocab_size = vocab_size(draft_model)
        self.num_layers = len(make_cache(draft_model))  # a reused cache's draft part, checked

    @property
    def overlap(self) -> float:
        return self.bridge.overlap

    def join(self, row: Row, layers: Optional[list] = None) -> RowCross:
        """The row's drafter, asked after its other searches; `layers`: a reused draft cache
        (a new one when there is none that fits)."""
        if layers is not None and len(layers) != self.num_layers:
            layers = None
        drafter = self.drafter_class(self.draft_model, self.bridge, row.request.sampling,
                                     self.target_vocab_size, self.draft_vocab_size, cache=layers,
                                     rule=self.rule, next_key=row.next_key)
        row.cross = RowCross(drafter)
        row.searchers.append(row.cross)
        return row.cross


def cross_draft(target_model, draft_model, tokenizer=None,
                draft_tokenizer=None) -> Tuple[Optional[object], Optional[BatchCross]]:
    """(the draft model for the batched draft, the cross draft): (draft_model, None) for a draft
    of the target's vocabulary (or one whose tokenizer is unknown), (None, BatchCross) for one
    of another, (None, None) when the two share too little to help (a warning says so)."""
    if draft_bridge(target_model, draft_model, tokenizer, draft_tokenizer) is None:
        return draft_model, None
    draft_model, bridge = pair_for(target_model, draft_model, tokenizer, draft_tokenizer)
    if bridge is None:
        return None, None
    return None, BatchCross(draft_model, bridge, vocab_size(target_model))
