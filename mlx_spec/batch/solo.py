"""A row alone on its model's own cache kinds: what a batch cannot hold, one row at a time.

`BatchCache` merges each row into mlx-lm's batched KVCache, which takes plain and
sliding-window attention and the recurrent state of the families tested in a batch (kv.py).
An engine that holds one row at a time (`BatchEngine(max_rows=1)`: the server's one request
at a time) needs no merging: its row keeps the cache list mlx-lm makes for one sequence, and
goes back as a call's does (`ModelCache`: attention trimmed, quantized or chunked layers
too; sliding windows made rewindable, attention sinks included; recurrent state restored
and its mixers replayed, or the whole model run again over the kept positions). So the
engine takes, a row at a time, quantized KV caches (mlx-lm's `kv_bits`), families whose code
cannot share a batch (`kv.UNBATCHABLE`) and recurrent families the batch has not been tested
on. Its token trees are a call's (tree_verify: the tree's mask and positions on the row's
own layers, the accepted path gathered to the front), where its cache kinds take them
(`takes_trees`: plain, quantized and sliding-window attention, no recurrent state).

The interface is BatchCache's, for one row: `forward` (B = 1), `keep(fed, kept)` (after the
verify pass, from the anchor `forward` set; after a draft's chain, its attention trimmed and
its recurrent state picked by `pick_states`), `join`, `drop`, `extract`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache.rewind import ModelCache, cache_length
from ..tree_verify import keep_path, tree_attention, tree_capable
from .kv import BatchCache


class SoloCache(BatchCache):
    """One model's cache for the one row an engine holds (none between rows)."""

    def __init__(self, model):
        super().__init__(model)
        self.cache: Optional[ModelCache] = None
        self._anchored = False  # the last forward may be undone (the verify pass's)

    @staticmethod
    def takes_trees(model) -> bool:
        """Whether a row of `model` on its own cache kinds can verify token trees."""
        return tree_capable(ModelCache(model, make_prompt_cache(model)))

    @staticmethod
    def prepare(model, layers: list, length: int) -> ModelCache:
        """The row's cache before it joins (its sliding windows made rewindable, in `layers`
        itself, before the prefill feeds them), holding `length` tokens."""
        return ModelCache(model, layers, length)

    @property
    def padding(self) -> List[int]:
        return [0] if self.cache is not None else []

    @padding.setter
    def padding(self, padding: List[int]) -> None:
        pass  # (one row: never padded)

    @property
    def attention(self) -> list:
        return self.cache.trimmable if self.cache is not None else []

    @property
    def recurrent(self) -> list:
        return self.cache.recurrent if self.cache is not None else []

    def forward(self, x: mx.array, undoable: bool = True) -> mx.array:
        """The model over x (1, T), lazily; with `undoable`, the point `keep` goes back to."""
        cache = self.cache
        cache.split, cache.capture = self.split, self.capture
        self._anchored = undoable
        if undoable:
            cache.anchor()
            cache.fed(x[0])  # (a replay of the whole model reads it, lazily)
        logits = cache.forward(x[0])
        self.hidden = None if cache.hidden is None else cache.hidden[None]
        return logits[None]

    def join(self, row_layers: Sequence, cache: Optional[ModelCache] = None) -> None:
        """The row joins: its prefilled cache list (or the `cache` prepared on it)."""
        if self.cache is not None:
            raise ValueError("A row alone's cache holds one row: drop it before the next joins.")
        self.cache = cache if cache is not None else self.prepare(
            self.model, row_layers, cache_length(row_layers))
        self.layers = self.cache.layers

    def drop(self, keep: Sequence[int]) -> None:
        if not keep:
            self.cache, self.layers, self._anchored = None, None, False

    def keep(self, fed: int, kept: Sequence[int]) -> None:
        """After a forward of `fed` positions, keep the first `kept[0]` of them: the verify
        pass's back to its anchor (ModelCache.keep); a draft's chain, fed outside `forward`,
        by trimming its attention (its recurrent state: `pick_states`)."""
        drop = fed - kept[0]
        anchored, self._anchored = self._anchored, False
        if drop <= 0:
            return
        cache = self.cache
        if anchored:
            cache.keep(cache.length - cache.anchor_length - drop)
        else:  # (the draft's model is called on its layers: it keeps no count of its own)
            for layer in cache.trimmable:
                layer.trim(drop)

    def tree_pass(self, trees, ancestors, steps):
        """The row's tree pass as a call's (tree_verify.tree_attention on its own layers)."""
        return tree_attention(self.attention, trees[0])

    def keep_paths(self, fed: int, kept_rows: Sequence[Sequence[int]],
                   kept: Sequence[int]) -> None:
        """After a tree pass: keep the row's first `kept[0]` nodes of `kept_rows[0]` (the root,
        then the accepted path), gathered to the front of what the pass fed, as a call's
        (tree_verify.keep_path)."""
        self._anchored = False
        keep_path(self.cache, list(kept_rows[0])[:kept[0]])

    def extract(self, row: int) -> list:
        """The row's own cache list (the caller's, when it handed one in)."""
        return self.cache.layers
