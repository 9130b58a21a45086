"""A DFlash block drafter for every row of a batch: one drafter pass per round drafts all blocks.

As alone (drafters/dflash.py), a row's context holds one row of keys/values
per target position it keeps, made from the target's hidden states at the
tap layers: a joining row's prompt taps are turned into context on its own
one-row cache during its prefill (`prefill`); after that the taps of each
round's kept positions wait per row (`Row.dflash_pending`) and are turned
into context at the next proposal in one pass, right-padded to the longest
and rolled into place (the MTP head's catch-up, batch/mtp.py). Rejected
drafts never enter the context, so nothing is ever trimmed.

The block of row i is [its last token] + [mask] * (size - 1) at positions
len(history) - 1.., one RoPE offset per row; its queries see the row's own
context (the left padding masked out) and the block (causally or not, and
within a sliding window, as the drafter's config says). A causal drafter
runs k + 1 rows per round, another its whole block. Each row draws its
drafts with its own sampling transform and random key (`draw_rows`), so q is
the distribution its drafts were drawn from; a DFlash2 drafter's selector walks
every row's block from the row's last token (`_walk`), its q over its candidates; a tree's
siblings beside spine row i come from the selector's distribution there given the spine's
draft before it (`kept_logits`), as a sequence's do (drafters/dflash2.py).

A row that leaves with its cache (the prompt-cache store) takes its context
along as a `DFlashContext` on the cache's first layer, as a single-stream
call leaves it (session.py); a row that joins from such a cache starts from
that context when it covers what the cache holds, else blind from there.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..attention import round_attention
from ..dflash.dflash2 import draft_logits
from ..dflash.model import DFlashModel
from ..dflash.taps import embedding, output_head, tap_capture
from .. import prompt_look
from ..drafters.dflash import DFlashContext, DFlashDrafter, embedding_scale, visibility
from ..drafters.dflash2 import DFlash2Drafter, logit_scale
from ..drafters.waiting import joined, right_padded
from ..precision import compute_dtype, head_for
from .drafts import draw_rows
from .kv import BatchCache
from .rows import Row


class BatchDFlash:
    source = "dflash"

    def __init__(self, drafter: DFlashModel, target_model):
        self.drafter = drafter
        self.keep_logits = False  # True: each proposal's block logits in kept_logits (trees)
        self.kept_logits: Optional[mx.array] = None  # (B, k, V) of the last proposal, lazy
        self.config = drafter.dflash_config
        self.capture = tap_capture(target_model, self.config.target_layer_ids)
        self.embed = embedding(target_model)
        self.head = head_for(output_head(target_model), compute_dtype(drafter))
        self.embed_scale = embedding_scale(target_model)
        self.selector = None  # DFlash2: its candidate selector and its logits' (multiplier, cap)
        if self.config.dflash2 is not None:
            self.embed_scale *= self.config.dflash2.input_embedding_scale
            self.selector = drafter.candidate_selector
            self.logit_scale = logit_scale(self.config.dflash2, target_model)
        self.target_model = target_model  # (a row alone's look builds a sequence's drafter)
        self.dtype = drafter.fc.weight.dtype
        self.cache = BatchCache(None)  # one KVCache of context per drafter layer

    @property
    def max_draft_tokens(self) -> int:
        return self.config.block_size - 1

    @property
    def cuttable(self) -> bool:
        """Causal inside the block: rows after k never reach rows 0..k (as alone; DFlash2's
        convolutions are causal and its selector walks rows 1..k)."""
        return self.config.all_causal

    def new_row_cache(self) -> list:
        return [KVCache() for _ in self.drafter.layers]

    def ready(self, row: Row) -> bool:
        """Whether the row has read anything (a one-token prompt has not before its first
        round)."""
        return row.dflash_ready

    def held_row_cache(self, row: Row, held: Optional[DFlashContext], cached: int) -> list:
        """A joining row's one-row context: what a reused cache kept (`held`, left on it by
        `kept_context`), when it is this drafter's and covers the `cached` tokens the row
        starts from; else an empty one (the drafter starts blind from there)."""
        if held is None or held.drafter is not self.drafter or \
                not held.start <= cached <= held.end:
            return self.new_row_cache()
        held.truncate(cached)
        if held.queued:  # into keys/values first: the prefill appends after them
            taps = joined(held.queued)
            self._extend(held.cache, taps[None], mx.array([held.start + held.cache[0].offset]))
            held.queued = []
        row.dflash_ready = held.cache[0].offset > 0
        return held.cache

    def kept_context(self, row: Row, cache: List[KVCache], last_taps: mx.array) -> DFlashContext:
        """A leaving row's context (`cache`: its keys/values, BatchCache.extract) as one
        `DFlashContext` covering its whole history, for the prompt-cache store: its waiting
        taps and `last_taps` (1, taps * H), the last token's (read as the row leaves), queued."""
        waiting = sum(taps.shape[0] for taps in row.dflash_pending)
        start = len(row.history) - 1 - waiting - cache[0].offset
        return DFlashContext(self.drafter, start, cache, row.dflash_pending + [last_taps])

    def prefill(self, row: Row, layers: list, taps: mx.array, start: int) -> None:
        """The taps (1, m, taps * H) of a prefill chunk at positions start.. become context."""
        self._extend(layers, taps, mx.array([start]))
        row.dflash_ready = True

    def _extend(self, layers: list, taps: mx.array, offsets: mx.array) -> None:
        rows = self.drafter.hidden_norm(self.drafter.fc(taps.astype(self.dtype)))  # (B, m, H)
        for layer, cache in zip(self.drafter.layers, layers):
            cache.update_and_fetch(*layer.self_attn.keys_values(rows, offsets))

    def propose(self, rows: Sequence[Row], k: int,
                drawn: Sequence[int]) -> Tuple[mx.array, List[Optional[mx.array]]]:
        """Drafts (B, k) and, per sampled row, q (drawn[i], V); lazy (as BatchDraft.propose)."""
        with round_attention():
            self._catch_up(rows)
            size = k + 1 if self.cuttable else self.config.block_size
            hidden = self._block(rows, size)[:, 1:k + 1]  # (B, k, H)
            if self.selector is not None:
                return self._walk(rows, hidden, drawn)
            logits = self.head(hidden)  # (B, k, V)
            self.kept_logits = logits if self.keep_logits else None  # (a tree's siblings)
            tokens, probs = [], [[] for _ in rows]
            for i in range(k):  # one draw per block row, each independent of the others
                tokens.append(draw_rows(rows, logits[:, i], probs, [i < n for n in drawn]))
        return mx.stack(tokens, axis=1), [mx.stack(p) if p else None for p in probs]

    def _walk(self, rows: Sequence[Row], hidden: mx.array,
              drawn: Sequence[int]) -> Tuple[mx.array, List[Optional[mx.array]]]:
        """DFlash2: every row's selector walk from its last token (as alone,
        `CandidateSelector.walk`), all rows at once. A sampled row's draft i < drawn[row] is
        drawn from softmax(score / T) over its candidates with its own key; q is that
        distribution, zero outside them. Other rows take the best score."""
        logits = draft_logits(self.head(hidden), *self.logit_scale)  # (B, k, V)
        previous = mx.array([row.history[-1] for row in rows], mx.uint32)
        temps = [0.0 if row.greedy else row.request.sampling.temp for row in rows]
        tokens, q = self.selector.walk(hidden, logits, previous, temps, drawn,
                                       lambda j, i: rows[j].next_key())
        self.kept_logits = None
        if self.keep_logits:  # a tree's siblings (batch/trees.py): as a sequence's (its draw)
            before = mx.concatenate([previous[:, None], tokens[:, :-1]], axis=1)  # (B, k)
            self.kept_logits = self.selector.logprobs(hidden, logits, before, 1.0)
        return tokens, q

    def _catch_up(self, rows: Sequence[Row]) -> None:
        """Every row's waiting taps into its context, in one pass right-padded to the longest."""
        pending = [joined(row.dflash_pending) for row in rows]
        if all(p is None for p in pending):
            return
        taps, lengths = right_padded(pending)  # (B, P, taps * H)
        # Row i's waiting taps sit just before its block: at len(history) - 1 - lengths[i]..
        offsets = mx.array([len(row.history) - 1 - n for row, n in zip(rows, lengths)])
        self._extend(self.cache.layers, taps, offsets)
        self.cache.align(lengths)
        for row in rows:
            row.dflash_pending = []

    def _block(self, rows: Sequence[Row], size: int) -> mx.array:
        """The drafter's normed block rows (B, size, H), each row after its own context."""
        block = mx.array([[row.history[-1]] + [self.config.mask_token_id] * (size - 1)
                          for row in rows], mx.uint32)  # (B, size)
        x = (self.embed(block) * self.embed_scale).astype(self.dtype)  # (B, size, H)
        offsets = mx.array([len(row.history) - 1 for row in rows])
        layers = self.cache.layers
        count = layers[0]._idx  # context entries per row, left padding included
        keys = [layer.keys[..., :count, :] for layer in layers]
        values = [layer.values[..., :count, :] for layer in layers]
        masks = [self._mask(i, count, size) for i in range(len(layers))]
        return self.drafter.block(x, keys, values, offsets, masks)

    def _mask(self, layer: int, count: int, size: int) -> mx.array:
        """Which keys each block query sees: (B, 1, size, count + size) booleans. Row i's
        context entry j sits count - j positions before its block (right-aligned), so the
        distances are the same for every row; only the left padding differs."""
        block = mx.arange(size)
        see_context, see_block = visibility(self.config, layer, block[:, None],
                                            mx.arange(-count, 0)[None, :], block[None, :])
        padding = mx.arange(count)[None, :] >= mx.array(self.cache.padding)[:, None]  # (B, count)
        see_context = see_context[None] & padding[:, None, :]  # (B, size, count)
        see_block = mx.broadcast_to(see_block[None], (padding.shape[0], size, size))
        return mx.concatenate([see_context, see_block], axis=-1)[:, None]

    def look(self, row: Row, layers: list, end: int, target_tail, sampling) -> dict:
        """The prompt look of a row alone (prompt_look.gather's {source: rows -> chances}),
        from its one-row context `layers` covering positions 0..`end` after its prefill: a
        sequence's drafter of this kind over that context (drafters/dflash.py's, or DFlash2's,
        anchored_rows), so the look is a call's, against the target's logits `target_tail`."""
        kind = DFlash2Drafter if self.selector is not None else DFlashDrafter
        view = kind(self.drafter, self.target_model, sampling, start=end,
                    context=DFlashContext(self.drafter, 0, layers))
        view.saw(row.history[1:end + 1])  # the token after each position
        return prompt_look.gather(target_tail, [view], sampling)

    def settle(self, rows: Sequence[Row], taps: mx.array, emitted: Sequence[List[int]]) -> None:
        """After verification: each row's kept positions (the target's taps (B, W + 1, .)
        there) wait for the next catch-up."""
        for i, (row, tokens) in enumerate(zip(rows, emitted)):
            row.dflash_pending = row.dflash_pending + [taps[i, :len(tokens)]]
            row.dflash_ready = True

