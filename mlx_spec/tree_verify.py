"""One target pass over a token tree, and the cache kept to the accepted path.

mlx-lm's models take no positions and no mask: each attention layer asks its
cache for the mask (`cache.make_mask(N, ...)`, through create_attention_mask)
and rotates queries and keys by `mx.fast.rope(..., offset=cache.offset)`,
i.e. positions offset, offset + 1, ... in input order. A flattened tree needs
node i at position offset + depth[i] and a mask where it sees the context and
its ancestors only. `tree_attention` gives both for the duration of the
forward, with no model code forked:

- the mask: every attention layer's `make_mask` answers the (N, offset + N)
  boolean mask [context all True | ancestor mask] (an instance attribute,
  removed after); the fused and the quantized attention both take a boolean
  array mask;
- the positions: `mx.fast.rope` on an input of the tree's N tokens rotates
  token i by offset + depth[i] (the N tokens go through the batch axis, where
  MLX takes one offset per row). nn.RoPE and mlx-lm's Llama-3 / YaRN /
  SuScaled ropes all call mx.fast.rope, so every family that takes its rope
  from there gets exact positions. Nodes at equal depth share a position, as
  in a decoding pass of their path.

So the keys and values a node writes are exactly those of its path decoded
alone, at the rows of its flattened index. `keep_path` then gathers the
accepted nodes' rows to the front (row base + j <- row base + path[j]) and
trims the rest: the cache holds the accepted path as if it had been decoded as
a chain. Kinds: KVCache and QuantizedKVCache (each of its (packed, scales,
biases) arrays is gathered the same way). Sliding windows (WindowKVCache),
chunked caches and recurrent state (ArraysCache) are not tree-capable
(`tree_capable`): their targets keep chains (see docs/drafting.md, "Token trees").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .tree import ancestor_mask, depths

TREE_KINDS = (KVCache, QuantizedKVCache)


def tree_capable(target) -> bool:
    """Whether a ModelCache's layers can verify a tree: plain or quantized attention only."""
    return not target.recurrent and all(type(layer) in TREE_KINDS for layer in target.trimmable)


@contextmanager
def tree_attention(layers, parents: Sequence[int]):
    """Inside the block, a forward of len(parents) tokens is a forward of that tree (see
    the module docstring): masks from `layers` (attention leaves), positions by depth."""
    n = len(parents)
    visible = mx.array(ancestor_mask(parents))  # (N, N)
    steps = mx.array(depths(parents))  # (N,)

    def make_mask(num, offset):
        if num != n:
            raise RuntimeError(f"a tree forward of {n} nodes was fed {num} tokens.")
        return mx.concatenate([mx.ones((n, offset), mx.bool_), visible], axis=1)  # (N, offset+N)

    for layer in layers:
        layer.make_mask = lambda num, *args, _layer=layer, **kwargs: make_mask(num, _layer.offset)
    fused = mx.fast.rope

    def rope(x, dims, *, offset, **kwargs):
        if x.ndim != 4 or x.shape[0] != 1 or x.shape[2] != n:
            return fused(x, dims, offset=offset, **kwargs)
        rows = x.transpose(2, 1, 0, 3)  # (N, H, 1, D): one node a row, its own offset
        return fused(rows, dims, offset=offset + steps, **kwargs).transpose(2, 1, 0, 3)

    mx.fast.rope = rope
    try:
        yield
    finally:
        mx.fast.rope = fused
        for layer in layers:
            del layer.make_mask


def keep_path(target, rows: Sequence[int]) -> None:
    """Keep, of the N nodes fed since the anchor, the `rows` (the root first, then the
    accepted path), in that order: gathered to the front, the rest trimmed."""
    base = target.anchor_length
    if list(rows) != list(range(len(rows))):
        index = mx.array([base + r for r in rows])
        for layer in target.trimmable:
            for arrays in (layer.keys, layer.values):
                for a in (arrays if isinstance(arrays, tuple) else (arrays,)):
                    a[..., base:base + len(rows), :] = a[..., index, :]
    target.keep(len(rows))
