"""The target's MTP head drafting for every row of a batch (`draft_model="mtp"`).

As alone (drafters/mtp.py), each row's MTP cache holds one entry per target
position: the pair (the target's hidden state there, the token after it), and the
computation is a single row's (head_chain.py `feed` and `chain`, over every row).
The pairs a round keeps wait per row (`Row.mtp_pending`) and are fed at the
next proposal in one pass, right-padded to the longest and rolled into place;
each row's output at its last pair drafts d1. Then k - 1 chained steps feed
the head's own output with the token it drafted, for all rows at once; every
row ran the same chain, so after verification all rows drop the same number
of entries (a trim). A joining row's prompt pairs come from its prefill; the
last one waits, so its first proposal has an output to draft from.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..attention import round_attention
from ..drafters.head_chain import chain, feed
from ..drafters.waiting import joined, right_padded
from .drafts import draw_rows
from .kv import BatchCache
from .rows import Row


class BatchMTP:
    """Any head that reads pairs: the MTP head, or an EAGLE-3 head (batch/eagle3.py)."""

    def __init__(self, head, source: str = "mtp"):
        self.head = head
        self.source = source
        self.cache = BatchCache(None)
        self.chained = 0  # entries the last proposal's chained steps added (every row)
        self.keep_logits = False  # True: each proposal's per-step logits in kept_logits
        self.kept_logits: Optional[mx.array] = None  # (B, k, V) of the last proposal, lazy

    def new_row_cache(self) -> list:
        return self.head.make_cache()

    def ready(self, row: Row) -> bool:
        """Whether the row has a pair to draft from (a one-token prompt has none at first)."""
        return row.mtp_ready

    def prefill(self, row: Row, layers: list, tokens: List[int], hidden: mx.array,
                last_chunk: bool) -> Optional[mx.array]:
        """Pairs (hidden (1, m, H), the token after each position) of a prefill chunk; the
        last pair of the prompt waits in the row's pending ones. Returns the head's outputs
        at the pairs fed (1, m', H), lazily (the prompt look's), or None."""
        pairs = list(zip(tokens, range(hidden.shape[1])))
        if last_chunk and pairs:
            *pairs, (token, i) = pairs
            row.mtp_pending = [([token], hidden[0, i:i + 1])]
            row.mtp_ready = True
        if not pairs:
            return None
        return feed(self.head, mx.array([[t for t, _ in pairs]], mx.uint32),
                    hidden[:, :len(pairs)], layers[0])

    def step_seconds(self, row: Row, repeats: int = 2) -> Optional[float]:
        """Seconds of one chained step (the head on its own output and a token, then its
        logits) on a one-row cache of its own fed the row's waiting pair, the fastest of
        `repeats`: what each draft after the first costs, for a row alone's policy before its
        first round (as the one-row head's step). None while the row has no pair."""
        if not row.mtp_pending:
            return None
        tokens, hidden = row.mtp_pending[-1]
        layer = self.new_row_cache()[0]
        token = mx.array([tokens[-1:]], mx.uint32)
        g = feed(self.head, token, hidden[None, -1:], layer)  # (1, 1, H)
        mx.eval(g)
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(self.head.logits(feed(self.head, token, g, layer)[:, 0]))
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    def propose(self, rows: Sequence[Row], k: int,
                drawn: Sequence[int]) -> Tuple[mx.array, List[Optional[mx.array]]]:
        """Drafts (B, k) and, per sampled row, q (drawn[i], V); lazy (as BatchDraft.propose)."""
        pending = [([t for block, _ in row.mtp_pending for t in block],
                    joined([h for _, h in row.mtp_pending])) for row in rows]
        hidden, _ = right_padded([h for _, h in pending])  # (B, P, H)
        width = hidden.shape[1]
        x = mx.array([t + [0] * (width - len(t)) for t, _ in pending], mx.uint32)  # (B, P)
        layer = self.cache.layers[0]
        with round_attention():
            g = feed(self.head, x, hidden, layer)  # (B, P, H)
            self.cache.align([len(t) for t, _ in pending])
            last = mx.array([max(len(t) - 1, 0) for t, _ in pending])[:, None, None]
            g = mx.take_along_axis(g, last, axis=1)[:, 0]  # (B, H)
            for row in rows:
                row.mtp_pending = []
            probs, kept = [[] for _ in rows], []

            def draw(logits: mx.array, i: int) -> mx.array:
                if self.keep_logits:  # (a token tree's siblings: batch/trees.py)
                    kept.append(logits)
                y = draw_rows(rows, logits, probs, [i < n for n in drawn])
                mx.async_eval(y)
                return y

            tokens = chain(self.head, g, layer, k, draw)
        self.chained = k - 1
        self.kept_logits = mx.stack(kept, axis=1) if kept else None
        return mx.stack(tokens, axis=1), [mx.stack(p) if p else None for p in probs]

    def settle(self, rows: Sequence[Row], ran: bool, hidden: mx.array,
               emitted: Sequence[List[int]]) -> None:
        """After verification: drop the chained entries; each row's kept positions (the
        target's `hidden` (B, W + 1, H) there) wait with the tokens after them."""
        if ran and self.chained:
            for layer in self.cache.layers:
                layer.trim(self.chained)
        self.chained = 0
        for i, (row, tokens) in enumerate(zip(rows, emitted)):
            row.mtp_pending = row.mtp_pending + [(tokens, hidden[i, :len(tokens)])]
            row.mtp_ready = True
