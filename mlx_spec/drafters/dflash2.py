"""Proposals from a DFlash2 block drafter: DFlash's block pass, then the candidate selector.

Everything a DFlash drafter does (context, block, positions, reused caches:
see dflash.py) holds; two things differ. The block is embedded with the
target's embedding times its scale times `input_embedding_scale`, and the
drafts are not one independent draw per row: the drafter's logits (the
target's head, times `output_multiplier`, soft-capped) give each row's
`selector_top_k` candidates, and the selector walks them left to right from
the last known token (`CandidateSelector.walk`). Greedy: each row's best
score. Temperature T > 0: row i's draft is drawn from softmax(score / T)
over its candidates, given the draft before it; q_i is that distribution,
zero outside the candidates, so the acceptance rule's q(x) and residual
max(0, p - q) over the whole vocabulary stay exact.

For a token tree (drafters/tree.py) the walk is the spine, and `draw` keeps
each row's selector distribution given the spine's draft before it
(`kept_logprobs`): siblings beside spine row i are drawn from that q_i (or,
greedy, are its next-best candidates), so they share the spine token's parent
and its distribution. They are leaves: their own continuation would need the
selector's scores given the sibling.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

from ..dflash.config import DFlash2Parts
from ..dflash.dflash2 import draft_logits
from ..mtp.heads import text_model
from .dflash import DFlashDrafter


class DFlash2Drafter(DFlashDrafter):
    prompt_logits = None  # its q is the selector's, not a transform of logits: prompt_probs

    def __init__(self, drafter, target_model, sampling, start=0, context=None):
        super().__init__(drafter, target_model, sampling, start=start, context=context)
        self.embed_scale *= self.config.dflash2.input_embedding_scale
        self.logit_scale = logit_scale(self.config.dflash2, target_model)  # (multiplier, cap)

    def logits(self, rows: mx.array) -> mx.array:
        """The drafter's logits (k, V) for its normed rows (k, H)."""
        return draft_logits(self.head(rows), *self.logit_scale)

    def prompt_probs(self, rows: int) -> Optional[mx.array]:
        """For the prompt look (T > 0), right after the prefill: q (r, V), lazy, of the first
        draft row anchored at each of the last r <= `rows` prompt positions (see
        anchored_rows): the selector's distribution over that row's candidates after the
        anchor's token, softmax(score / T), as its walk draws the row; None as prompt_logits."""
        anchored = self.anchored_rows(rows)
        if anchored is None or self.sampling.greedy:
            return None
        hidden, anchors = anchored
        return mx.exp(self.drafter.candidate_selector.logprobs(
            hidden, self.logits(hidden), anchors, self.sampling.temp))

    def draw(self, rows: mx.array, anchor: int):
        """The selector's drafts from rows 1..k (k, H) and q (k, V), or None when greedy.
        `keep_logprobs` (a tree's): kept_logprobs (k, V) is log q_i, row i's distribution
        given the draft before it; greedy, the same at temperature 1 (its ranking is the
        scores', the draft first)."""
        logits = self.logits(rows)  # (k, V)
        temp = 0.0 if self.sampling.greedy else self.sampling.temp
        tokens, q = self.drafter.candidate_selector.walk(
            rows[None], logits[None], mx.array([anchor], mx.uint32), [temp], [rows.shape[0]])
        tokens, q = tokens[0], q[0]  # (k,), (k, V) or None
        self.kept_logprobs = None
        if self.keep_logprobs:  # (a token tree's siblings: drafters/tree.py)
            previous = mx.concatenate([mx.array([anchor], mx.uint32), tokens[:-1]])  # (k,)
            self.kept_logprobs = mx.log(q) if q is not None else \
                self.drafter.candidate_selector.logprobs(rows, logits, previous, 1.0)
        return tokens, q


def logit_scale(parts: DFlash2Parts, target_model) -> Tuple[float, Optional[float]]:
    """(output multiplier, soft cap) of the drafter's logits: its config's, or, when the config
    leaves both at the defaults, the target's own where its args have an output_multiplier."""
    if parts.output_multiplier != 1.0 or parts.final_logit_softcapping is not None:
        return parts.output_multiplier, parts.final_logit_softcapping
    args = getattr(text_model(target_model), "args", None)
    args = getattr(args, "text", args)  # (a multimodal target's text settings)
    if args is None or getattr(args, "output_multiplier", None) is None:
        return 1.0, None
    cap = getattr(args, "final_logit_softcapping", None)
    return float(args.output_multiplier), float(cap) if cap else None
