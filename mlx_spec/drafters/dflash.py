"""Proposals from a DFlash block drafter: one pass fills a whole block of mask positions.

The loop hands it the target's tapped hidden states at every position the
target keeps (`follow`: prefill chunks, the kept rows of a verify pass, plain
steps); they are queued and turned into context keys/values in one pass at the
next proposal (`catch_up`). A proposal embeds [last token] + [mask] * (B - 1)
with the target's embedding, runs the drafter's layers over it once, and reads
the first k drafts from rows 1..k through the target's output head. Rejected
drafts never enter its cache (only context rows do), so `commit` has nothing
to undo. q for the acceptance rule: per row, the drafter's distribution after
the same sampling transform as the target's; the rows come from one parallel
pass, so q_i does not depend on d_1..d_{i-1}, which the rule allows.

Positions: context row r sits at absolute position start + r, where `start`
is how many tokens the target cache held when the context began; the block
starts right after the context.

A reused prompt cache keeps the context with it (`DFlashContext`, left on the
cache by the call's `Session.settle`, which also taps the tokens it feeds):
the next call's drafter carries on from the earlier turns' taps. A cache with
no context of this drafter covering exactly what it holds (new, loaded from a
file, or fed by something else since) starts blind from its length, which
costs acceptance, never exactness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..attention import round_attention
from ..dflash.model import DFlashModel
from ..dflash.taps import embedding, output_head
from ..mtp.heads import model_type, text_model
from ..precision import compute_dtype, head_for
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from .protocol import Proposal
from .waiting import joined


LOOK_TOKENS = 64  # followed tokens kept for the prompt look (prompt_look.ROWS and one more)
LOOK_BYTES = 64 << 20  # the prompt look's copies of the context keys/values, at most


@dataclass
class DFlashContext:
    """What a drafter has read of the target: its context keys/values per layer, from absolute
    position `start`, and the tapped rows not yet turned into them (`queued`)."""

    drafter: DFlashModel
    start: int
    cache: List[KVCache]
    queued: List[mx.array] = field(default_factory=list)  # (m, taps * H) tapped target rows

    @property
    def end(self) -> int:
        """The position after the last one it covers."""
        return self.start + self.cache[0].offset + sum(rows.shape[0] for rows in self.queued)

    def truncate(self, end: int) -> None:
        """Cover only the positions before `end` (>= start): rows beyond it are dropped."""
        drop = self.end - end
        while drop > 0 and self.queued:
            rows = self.queued.pop()
            if rows.shape[0] > drop:
                self.queued.append(rows[: rows.shape[0] - drop])
            drop -= min(drop, rows.shape[0])
        for cache in self.cache:
            cache.trim(drop)


class DFlashDrafter:
    source = "dflash"
    follows_target = True  # the loop hands it the target's tapped hidden states (`follow`)
    keep_logprobs = False  # True: each proposal's per-row log q in kept_logprobs (a tree's)
    kept_logprobs: Optional[mx.array] = None  # (k, V) of the last proposal, lazy

    def __init__(self, drafter: DFlashModel, target_model, sampling: SamplingConfig,
                 start: int = 0, context: Optional[DFlashContext] = None):
        """`start`: the tokens the target cache holds; `context`: what a reused cache kept of
        the earlier turns (used when it is this drafter's and covers them all)."""
        self.drafter = drafter
        self.config = drafter.dflash_config
        self.sampling = sampling
        self.block_size = self.config.block_size
        self.embed = embedding(target_model)
        self.head = head_for(output_head(target_model), compute_dtype(drafter))
        self.embed_scale = embedding_scale(target_model)
        self.call_start = start
        if context is not None and context.drafter is drafter and \
                context.start <= start <= context.end:
            context.truncate(start)  # (a cache trimmed since holds a prefix)
        else:  # blind for what the cache holds
            context = DFlashContext(drafter, start, [KVCache() for _ in drafter.layers])
        self.context = context
        # The last LOOK_TOKENS tokens followed before the first proposal (the prompt look's
        # anchors); None once it has proposed: rounds record nothing.
        self._after: Optional[List[int]] = []

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    def follow(self, tokens: List[int], hidden: mx.array) -> None:
        """The target's tapped hidden states (len(tokens), taps * H) at the positions it kept;
        `tokens`: the token after each."""
        self.context.queued.append(hidden)
        self.saw(tokens)

    def saw(self, tokens: List[int]) -> None:
        """The token after each position it was handed (`follow`), or that its context holds
        already (a batch row alone's prefill: batch/dflash.py's look): the prompt look's
        anchors, until its first proposal."""
        if self._after is not None:
            self._after = (self._after + list(tokens))[-LOOK_TOKENS:]

    def prompt_logits(self, rows: int) -> Optional[mx.array]:
        """For the prompt look, right after the prefill: the logits (r, V), lazy, of the
        block's first draft row at the last r <= `rows` prompt positions that have a context
        row before them (they predict the prompt's last r tokens); None when fewer than two
        positions were seen."""
        anchored = self.anchored_rows(rows)
        return None if anchored is None else self.head(anchored[0])

    def anchored_rows(self, rows: int):
        """(first draft rows (r, H), anchor tokens (r,)): at each of the last r <= `rows`
        prompt positions a with a context row before them, the block [a's token] + masks at
        positions a.. over the context before a, as a round anchored there would run it."""
        self.catch_up()
        context, caches = self.context, self.context.cache
        count, after = caches[0].offset, self._after or []  # after[-1]: after the last row
        r = min(rows, len(after) - 1, count - 1)
        if r < 1:
            return None
        end = context.start + count  # the last prompt token's position (the next anchor)
        anchors = mx.arange(end - r, end)
        size = 2 if self.cuttable else self.block_size
        anchor_tokens = after[-(r + 1):-1]
        tokens = mx.array([[t] + [self.config.mask_token_id] * (size - 1)
                           for t in anchor_tokens], mx.uint32)  # (r, size)
        keys = [c.keys[..., :count, :] for c in caches]
        values = [c.values[..., :count, :] for c in caches]
        width = keys[0].shape[1] * keys[0].shape[-1] * keys[0].dtype.size * 2 * len(keys)
        group = max(1, min(r, LOOK_BYTES // max(1, width * count)))  # broadcast context copies
        first_rows = []
        for first in range(0, r, group):
            a = anchors[first:first + group]
            n = a.shape[0]
            x = self.embed(tokens[first:first + group]) * self.embed_scale  # (n, size, H)
            masks = [anchored_mask(self.config, i, context.start, count, a, size)
                     for i in range(len(caches))]
            out = self.drafter.block(
                x.astype(self.drafter.fc.weight.dtype),
                [mx.broadcast_to(k, (n,) + k.shape[1:]) for k in keys],
                [mx.broadcast_to(v, (n,) + v.shape[1:]) for v in values], a, masks)
            first_rows.append(out[:, 1])  # (n, H)
        first_rows = first_rows[0] if len(first_rows) == 1 else mx.concatenate(first_rows)
        return first_rows, mx.array(anchor_tokens, mx.uint32)

    def catch_up(self) -> list:
        """Turn the queued rows into context keys/values (lazily); the arrays holding them."""
        context, caches = self.context, self.context.cache
        if context.queued:
            taps = joined(context.queued)
            context.queued = []
            rows = self.drafter.context(taps.astype(self.drafter.fc.weight.dtype))  # (1, m, H)
            offset = context.start + caches[0].offset
            for layer, cache in zip(self.drafter.layers, caches):
                cache.update_and_fetch(*layer.self_attn.keys_values(rows, offset))
        return [c.state for c in caches if c.keys is not None]

    def can_propose(self, history: List[int]) -> bool:
        return bool(self.context.queued) or self.context.cache[0].offset > 0

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        self._after = None  # past the prompt: the look is over
        k = min(k, self.block_size - 1)
        with round_attention():  # a causal block cut after row k is exactly its first rows
            rows = self.block_rows(history, k + 1 if self.cuttable else self.block_size)
        if rows is None:  # nothing seen yet (a one-token prompt): a plain step first
            return None
        tokens, probs = self.draw(rows[0, 1:k + 1], history[-1])
        mx.async_eval(tokens, *([probs] if probs is not None else []))
        return Proposal(tokens, probs, self.source, self)

    @property
    def cuttable(self) -> bool:
        """Causal inside the block: rows after k never reach rows 0..k, so a round drafting
        k runs a block of k + 1. (DFlash2's convolutions are causal too, and its selector
        walks rows 1..k left to right.)"""
        return self.config.all_causal

    def block_rows(self, history: List[int], size: Optional[int] = None) -> Optional[mx.array]:
        """The drafter's normed rows (1, size, H) for the block [last token] + [mask] *
        (size - 1), size the block size unless given, after everything it has read; None
        before it has read anything."""
        size = size or self.block_size
        self.catch_up()
        start, caches = self.context.start, self.context.cache
        count = caches[0].offset
        if count == 0:
            return None
        block = mx.array([history[-1]] + [self.config.mask_token_id] * (size - 1), mx.uint32)
        x = self.embed(block[None]) * self.embed_scale  # (1, B, H)
        offset = start + count
        keys, values, masks = [], [], []
        for i, cache in enumerate(caches):
            first = _first_visible(self.config.window(i), count)
            keys.append(cache.keys[..., first:count, :])
            values.append(cache.values[..., first:count, :])
            masks.append(block_mask(self.config, i, offset - (count - first), offset, size))
        return self.drafter.block(x.astype(self.drafter.fc.weight.dtype), keys, values, offset,
                                  masks)

    def draw(self, rows: mx.array, anchor: int):
        """The drafts from rows 1..k (k, H) and q (k, V), or None when greedy: one draw per
        row, each independent of the others."""
        draft_logprobs = logprobs_from_logits(self.head(rows), self.sampling)  # (k, V)
        tokens = sample(draft_logprobs, self.sampling)  # (k,)
        self.kept_logprobs = draft_logprobs if self.keep_logprobs else None  # (siblings' q)
        return tokens, None if self.sampling.greedy else mx.exp(draft_logprobs)

    def commit(self, num_accepted: int) -> None:
        pass  # the block never entered the cache; the kept rows come back through `follow`

    # A reused prompt cache (session.py): the session shows the target's layers only, and at
    # the end hands over the taps of the tokens it feeds, then keeps `context` with the cache.
    def peek(self, history: List[int], num_tokens: int, upcoming: List[int] = ()):
        return None  # the context is not part of the caller's cache while a response is out

    def settle(self, history: List[int], num_tokens: int) -> None:
        """Cover exactly the call's first `num_tokens` tokens after what the cache held."""
        self.context.truncate(self.call_start + num_tokens)


def _first_visible(window: Optional[int], count: int) -> int:
    """The oldest context row any block query of a sliding layer can see (the first query
    sees the window - 1 rows before it); 0 for a full layer."""
    return 0 if window is None else max(0, count - (window - 1))


def visibility(config, layer: int, query: mx.array, context: mx.array, block: mx.array):
    """(sees context, sees block): which keys a block query sees in `layer`, from absolute
    positions that broadcast: queries `query` (..., size, 1) over context rows `context`
    (..., 1, count) and the block's own rows `block` (..., 1, size). z-lab's rule: key j is
    visible to query p if p - j < window (and j - p < window in a bidirectional sliding
    layer); inside the block causal layers see only earlier rows. The one rule of every
    DFlash mask: a round's block (block_mask), the prompt look's blocks (anchored_mask) and
    a batch's rows (mlx_spec.batch.dflash)."""
    window, causal = config.window(layer), config.causal(layer)
    see_context = mx.ones(mx.broadcast_shapes(query.shape, context.shape), mx.bool_)
    see_block = block <= query if causal else \
        mx.ones(mx.broadcast_shapes(query.shape, block.shape), mx.bool_)
    if window is not None:
        see_context = see_context & (query - context < window)
        see_block = see_block & (query - block < window)
        if not causal:
            see_block = see_block & (block - query < window)
    return see_context, see_block


def block_mask(config, layer: int, context_start: int, offset: int,
               block_size: int) -> Optional[mx.array]:
    """Which keys each block query sees in `layer`: (B, context rows + B) booleans, or None
    for all. Context rows sit at positions context_start..offset - 1, the block at offset.."""
    if config.window(layer) is None and not config.causal(layer):
        return None
    block = mx.arange(offset, offset + block_size)
    see_context, see_block = visibility(config, layer, block[:, None],
                                        mx.arange(context_start, offset)[None, :], block[None, :])
    return mx.concatenate([see_context, see_block], axis=1)


def anchored_mask(config, layer: int, context_start: int, count: int, anchors: mx.array,
                  size: int) -> mx.array:
    """block_mask for a batch of blocks (n, 1, size, count + size): block j anchored at
    position anchors[j], over the `count` context rows from position context_start, of which
    it sees those before it (the prompt look: what a round anchored there would see)."""
    block = anchors[:, None, None] + mx.arange(size)[None, None, :]  # (n, 1, size)
    context = context_start + mx.arange(count)[None, None, :]  # (1, 1, count)
    see_context, see_block = visibility(config, layer, block.swapaxes(1, 2), context, block)
    see_context = see_context & (context < anchors[:, None, None])
    n = anchors.shape[0]
    return mx.concatenate([mx.broadcast_to(see_context, (n, size, count)),
                           mx.broadcast_to(see_block, (n, size, size))], axis=-1)[:, None]


def embedding_scale(target_model) -> float:
    """What the target's own forward multiplies its embeddings by (Gemma: sqrt(hidden))."""
    if model_type(target_model).startswith("gemma"):
        hidden = text_model(target_model).args.hidden_size
        return float(mx.array(hidden ** 0.5, mx.bfloat16).astype(mx.float32).item())
    return 1.0
