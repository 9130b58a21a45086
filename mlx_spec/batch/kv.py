"""One model's cache for a batch of rows: mlx-lm's `BatchKVCache`, with per-row rewind.

Rows are right-aligned: every row's newest entry sits at the same index, the
older ones start after its left padding (mlx-lm's layout, which its models
already mask and position with per-row RoPE offsets). A round feeds every row
the same number of positions; rows then keep different numbers of them.
Going back is two steps: every row drops the fewest any row rejects (`trim`,
host metadata), then each row with more to drop is rolled right by the rest,
which moves its rejected entries out past the end and grows its left padding
(mlx-lm's `finalize` for right-padded prompts does the same roll). Rows join
(`join`: a one-row cache prefilled alone) and leave (`drop`) between rounds.

Batched here: attention layers of the plain `KVCache` kind (dense, MoE and
most mlx-lm families). Quantized, sliding-window and recurrent layers are
served one request at a time by the ordinary loop (`batchable`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

# Left padding every row has: sliced off when it reaches this many positions.
COMPACT_AT = 64


def batchable(model) -> bool:
    """Whether every layer mlx-lm makes for `model` is a plain KVCache (then it batches here)."""
    return all(type(layer) is KVCache for layer in make_prompt_cache(model))


class BatchCache:
    """The layers of one model for every row, and each row's left padding on the host."""

    def __init__(self, model):
        self.model = model
        self.layers: Optional[List[BatchKVCache]] = None  # None: no rows yet
        self.padding: List[int] = []

    @property
    def rows(self) -> int:
        return len(self.padding)

    def join(self, row_layers: Sequence[KVCache]) -> None:
        """Add one row: its own prefilled cache list (it may hold any number of tokens)."""
        merged = [BatchKVCache.merge([layer]) for layer in row_layers]
        if self.layers is None:
            self.layers = merged
            self.padding = [0]
            return
        before = self.layers[0]._idx
        for layer, new in zip(self.layers, merged):
            layer.extend(new)
        shift = self.layers[0]._idx - before  # the old rows were padded on the left by this
        self.padding = [p + shift for p in self.padding] + [self.layers[0]._idx - row_layers[0].offset]

    def drop(self, keep: Sequence[int]) -> None:
        """Keep only the rows at indices `keep` (in that order)."""
        if not keep:
            self.layers, self.padding = None, []
            return
        index = mx.array(list(keep))
        for layer in self.layers:
            layer.filter(index)  # also slices off the padding every row has
        padding = [self.padding[i] for i in keep]
        self.padding = [p - min(padding) for p in padding]

    def keep(self, fed: int, kept: Sequence[int]) -> None:
        """After a forward of `fed` positions per row, row i keeps its first `kept[i]` of them."""
        rejected = [fed - n for n in kept]
        common = min(rejected)
        for layer in self.layers:
            if common:
                layer.trim(common)
        rest = [r - common for r in rejected]
        if any(rest):
            for layer in self.layers:
                layer.prepare(right_padding=rest)
                layer.finalize()  # rolls each row right by its rest: lazy
        self.padding = [p + r for p, r in zip(self.padding, rest)]
        if min(self.padding) >= COMPACT_AT:
            self._compact(min(self.padding))

    def _compact(self, n: int) -> None:
        for layer in self.layers:
            layer.keys = layer.keys[..., n:, :]
            layer.values = layer.values[..., n:, :]
            layer._idx -= n
            layer.left_padding = layer.left_padding - n
        self.padding = [p - n for p in self.padding]

    def extract(self, row: int) -> List[KVCache]:
        """Row `row`'s entries as an ordinary one-row cache list (for the prompt-cache store)."""
        out = []
        for layer in self.layers:
            cache = KVCache()
            start = self.padding[row]
            cache.keys = mx.contiguous(layer.keys[row:row + 1, :, start:layer._idx])
            cache.values = mx.contiguous(layer.values[row:row + 1, :, start:layer._idx])
            cache.offset = layer._idx - start
            out.append(cache)
        return out

    def length(self, row: int) -> int:
        """How many entries row `row` holds."""
        return self.layers[0]._idx - self.padding[row]

    def state(self) -> list:
        return [] if self.layers is None else [a for layer in self.layers
                                               for a in (layer.keys, layer.values)]
