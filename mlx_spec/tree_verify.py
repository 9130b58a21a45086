"""One target pass over a token tree, and the cache kept to the accepted path.

mlx-lm's models take no positions and no mask: each attention layer asks its
cache for the mask (`cache.make_mask(N, ...)`, through create_attention_mask)
and rotates queries and keys by `mx.fast.rope(..., offset=cache.offset)`,
i.e. positions offset, offset + 1, ... in input order. A flattened tree needs
node i at position p_i = offset + depth[i] and a mask where it sees the context
and its ancestors only. `tree_attention` gives both for the duration of the
forward, with no model code forked:

- the mask (`tree_mask`): every attention layer's `make_mask` answers an
  (N, K) boolean mask over the K keys its cache returns (an instance
  attribute, removed after): [context | ancestor mask], AND what a query at
  p_i decoded alone would see of those keys (cache/window.py's `visible`, the
  one sliding-window rule). For KVCache and QuantizedKVCache the keys are
  positions 0 .. offset - 1, then the nodes; the window is the model's
  `window_size` where it asks for one (none: the whole context). For a
  WindowKVCache the context's columns are its buffer entries
  (`key_positions`: the kept first tokens, then from the buffer's start, which
  moves as it compacts), the window and the kept tokens its own. So a node
  also loses an ancestor further back than the window, as its path decoded
  alone would. The fused and the quantized attention both take a boolean
  array mask;
- the positions: `mx.fast.rope` on an input of the tree's N tokens rotates
  token i by offset + depth[i] (the N tokens go through the batch axis, where
  MLX takes one offset per row). nn.RoPE and mlx-lm's Llama-3 / YaRN /
  SuScaled ropes all call mx.fast.rope, so every family that takes its rope
  from there gets exact positions (gemma3_text's two ropes, one per layer
  kind, included). Nodes at equal depth share a position, as in a decoding
  pass of their path.

So the keys and values a node writes are exactly those of its path decoded
alone, at the rows of its flattened index: the last N rows of every layer's
buffer. `keep_path` then gathers the accepted nodes' rows to the front of
those N (row base + j <- row base + path[j]) and trims the rest: the cache
holds the accepted path as if it had been decoded as a chain. Kinds
(`tree_capable`): KVCache, QuantizedKVCache (each of its (packed, scales,
biases) arrays is gathered the same way) and WindowKVCache (its rows are
buffer entries, base = entries in use - N; the trim is its own, host
metadata within its reserve), alone or mixed (hybrid sliding/global targets
such as Gemma-3 and gpt-oss). Chunked caches and recurrent state
(ArraysCache) are not tree-capable: their targets keep chains (see
docs/drafting.md, "Token trees").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .cache.rewind import leaves, make_rewindable
from .cache.window import WindowKVCache, visible
from .tree import ancestor_mask, depths

TREE_KINDS = (KVCache, QuantizedKVCache, WindowKVCache)


def tree_capable(target) -> bool:
    """Whether a ModelCache's layers can verify a tree: attention caches of TREE_KINDS only
    (plain, quantized, sliding windows, in any mix), no recurrent state, and a model whose
    positions follow the tree's (`positions_follow`)."""
    return not target.recurrent and all(type(layer) in TREE_KINDS for layer in target.trimmable) \
        and positions_follow(target.model)


PROBED = "_mlx_spec_tree_positions"  # on a model: what `positions_follow` found


def positions_follow(model) -> bool:
    """Whether a tree pass gives a node the logits its path decoded alone gives: true where the
    model takes its positions from mx.fast.rope (patched here); false where it computes them
    itself (GPT BigCode's and GPT-2's learned position embeddings, read from the cache's
    offset: a node would get its flattened index, not its depth). Probed once per model: a
    node beside its sibling at depth 1 against that node decoded after the root alone."""
    found = getattr(model, PROBED, None)
    if found is None:
        from mlx_lm.models.cache import make_prompt_cache

        context, (root, first, second) = mx.array([[1, 2]]), (3, 4, 5)
        tree_cache, chain_cache = make_prompt_cache(model), make_prompt_cache(model)
        make_rewindable(tree_cache)  # (sliding windows: as a call's tree pass meets them)
        model(context, cache=tree_cache)
        model(context, cache=chain_cache)
        try:
            with tree_attention([c for c in leaves(tree_cache) if type(c) in TREE_KINDS],
                                (-1, 0, 0)):
                in_tree = model(mx.array([[root, first, second]]), cache=tree_cache)[0, 2]
            alone = model(mx.array([[root, second]]), cache=chain_cache)[0, 1]
            in_tree, alone = in_tree.astype(mx.float32), alone.astype(mx.float32)
            # (the pass's own rounding, bfloat16's included: a small share of the logits'
            # spread; a misplaced node's logits differ by about their spread, 0.65-1.3 of it
            # in GPT BigCode's and GPT-2's tiny models)
            error = mx.sqrt(mx.mean(mx.square(in_tree - alone)))
            found = bool(error <= 0.05 * mx.std(alone) + 1e-4)
        except ValueError:  # a mask of the wrong shape: a model that builds its masks from a
            found = False  # layer the tree's mask never reaches (Nemotron-NAS, a linear first)
        object.__setattr__(model, PROBED, found)  # (not a parameter)
    return found


def tree_mask(layer, ancestors: mx.array, steps: mx.array,
              window_size: Optional[int] = None) -> mx.array:
    """(N, K) bool over the K keys `layer` returns to the tree's N nodes (the tree's own
    entries last): node i, at position offset + steps[i], sees a key iff a query at that
    position decoded alone would (the layer's window, `window_size` where the model asks for
    one) and the key is the context's or one of its `ancestors` (N, N)."""
    n = steps.shape[0]
    if isinstance(layer, WindowKVCache):  # the context's keys as the buffer holds them
        context = layer.key_positions(n)[:-n]  # (K - N,)
        window, keep = layer.window(window_size), layer.keep
    else:
        context = mx.arange(layer.offset)  # (offset,)
        window, keep = window_size, 0
    nodes = layer.offset + steps  # (N,) absolute positions
    seen = visible(nodes, mx.concatenate([context, nodes]), window, keep)  # (N, K)
    return seen & mx.concatenate([mx.ones((n, context.shape[0]), mx.bool_), ancestors], axis=1)


@contextmanager
def tree_attention(layers, parents: Sequence[int]):
    """Inside the block, a forward of len(parents) tokens is a forward of that tree (see
    the module docstring): masks from `layers` (attention leaves), positions by depth."""
    ancestors = mx.array(ancestor_mask(parents))  # (N, N)
    steps = mx.array(depths(parents), mx.int32)  # (N,)
    with tree_forward(layers, steps[None],
                      lambda layer, window: tree_mask(layer, ancestors, steps, window)):
        yield


@contextmanager
def tree_forward(layers, steps: mx.array, mask):
    """Inside the block, a forward of B rows of N tokens is a forward of B trees (one
    sequence's: B = 1; a batch's: batch/trees.py): every attention layer in `layers` answers
    `mask(layer, window_size)` for its mask, and `mx.fast.rope` rotates node i of row b by the
    row's offset + steps[b, i] (steps (B, N): the nodes' depths; the B N nodes go through
    RoPE's batch axis, where MLX takes one offset per row)."""
    rows, n = steps.shape

    def make_mask(layer, num, return_array=False, window_size=None, **kwargs):  # an array
        if num != n:
            raise RuntimeError(f"a tree forward of {n} nodes was fed {num} tokens.")
        return mask(layer, window_size)

    for layer in layers:
        layer.make_mask = lambda *args, _layer=layer, **kwargs: make_mask(_layer, *args, **kwargs)
    fused = mx.fast.rope

    def rope(x, dims, *, offset, **kwargs):
        if x.ndim != 4 or x.shape[0] != rows or x.shape[2] != n:
            return fused(x, dims, offset=offset, **kwargs)
        heads, d = x.shape[1], x.shape[3]
        nodes = x.transpose(0, 2, 1, 3).reshape(rows * n, heads, 1, d)  # one node a row
        offsets = (mx.broadcast_to(mx.array(offset), (rows,))[:, None] + steps).reshape(-1)
        out = fused(nodes, dims, offset=offsets, **kwargs)
        return out.reshape(rows, n, heads, d).transpose(0, 2, 1, 3)

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
    fed = target.length - target.anchor_length  # N: the last N entries of every buffer
    if list(rows) != list(range(len(rows))):
        for layer in target.trimmable:
            if layer.keys is None:  # (a layer whose attention ignores its cache: Nemotron-NAS)
                continue
            base = _entries(layer) - fed  # the root's buffer row
            index = mx.array([base + r for r in rows])
            for arrays in (layer.keys, layer.values):
                for a in (arrays if isinstance(arrays, (tuple, list)) else (arrays,)):
                    a[..., base:base + len(rows), :] = a[..., index, :]
    target.keep(len(rows))


def _entries(layer) -> int:
    """Buffer rows in use: a window's buffer starts past what it has dropped."""
    return layer.used if isinstance(layer, WindowKVCache) else layer.offset
