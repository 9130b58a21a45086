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

Recurrent layers (`ArraysCache`) of Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next, OLMo
Hybrid), short-convolution hybrids (LFM2, LFM2-MoE), Mamba-2 hybrids (Nemotron-H, Granite
4.0-H, PLaMo 2, Falcon-H1: each layer's attention and state in one mlx-lm CacheList, whose
leaves are handled as any other's), Mamba hybrids (Jamba), Kimi Delta Attention (Kimi-Linear,
Kimi-K3, Bailing-MoE-V3), RG-LRU (RecurrentGemma), gated linear attention (Bailing-MoE-Linear,
Bailing hybrid) and short convolutions beside sliding windows (Gear) batch too:
their state is per row, not per position, so a forward that may be undone
first keeps the states it starts from (references: free) and records each
mixer's inputs (cache/replay.py); going back restores them and re-runs each
row's kept prefix (`MixerReplay.replay_rows`: a Gated DeltaNet's recurrence
alone, masked past each row's end; another mixer once per distinct kept
length, on the rows that keep that many), lazily, evaluated with the next
round.

Sliding-window layers (mlx-lm's `RotatingKVCache`: Gemma 3, gpt-oss) keep
their whole history in a batch, as a full attention layer would: the window
is the mask's (the models hand `window_size` to `make_mask`, and within a row
buffer distance is token distance), so nothing rotates and every row rewinds
as any other. The price is memory: such a layer holds the whole context
instead of the window.

Models with no attention layer (Mamba, Mamba-2, RWKV-7: `RECURRENT_ONLY`) batch too:
each row has its state and no padding (rows are prefilled alone and every
round feeds all rows the same number of positions, so nothing needs aligning).

Batched here: plain and sliding-window attention layers (dense, MoE and most
mlx-lm families; Gemma 2, whose queries are grouped by key head, with its mask shaped for
them: `grouped`) beside the recurrent layers of those families, and those
recurrent-only families. Other recurrent families (untested here) and quantized
KV caches (mlx-lm has no batched one) decode one row at a time, each on its own cache kinds
(`batchable`; solo.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, CacheList, KVCache, RotatingKVCache,
                                 make_prompt_cache)

from ..cache.replay import MixerReplay
from ..cache.rewind import leaves
from ..cache.window import visible
from ..tree_verify import tree_forward
from ..mtp.heads import model_type

# Left padding every row has: sliced off when it reaches this many positions.
COMPACT_AT = 64


# Families whose recurrent layers batch (MixerReplay.replay_rows): all Gated DeltaNets
# (replayed by their recurrence alone), or mixers replayed by kept length on batch-first
# state (short convolutions, Mamba-2 and Mamba, OLMo Hybrid's Gated DeltaNet with its three
# convolutions, Kimi Delta Attention, RG-LRU, gated linear attention) beside attention layers,
# the families tested here (tests/test_batch.py, tests/test_more_families.py).
GATED_DELTANET = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
REPLAYED_BY_LENGTH = ("lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid", "jamba", "plamo2",
                      "olmo_hybrid", "falcon_h1", "kimi_linear", "recurrent_gemma",
                      "bailing_moe_linear", "bailing_hybrid", "bailing_moe_v3", "gear", "kimi_k3")
# ... and the families with no attention layer, replayed so too (a state a row, no padding;
# RWKV-7's time mix and channel mix, which share a layer's cache, one after the other)
RECURRENT_ONLY = ("mamba", "mamba2", "rwkv7")
# Families whose attention groups queries by key head, (B, kv heads, repeats, L, D), and adds
# the mask to scores of that shape (Gemma 2): a batch's mask (B, 1, L, S) takes an axis for the
# repeats (`grouped`), which a call's (L, S) mask needs not.
GROUPED_QUERIES = ("gemma2",)
# Families whose code cannot share a batch, and why (each exact in a call, one request at a
# time; tests/test_unbatchable.py shows every fault through the batch's own cache, so a test
# fails should mlx-lm mend one). Found by running mlx-lm's families through the batch.
UNBATCHABLE = {
    # rope(queries, offset=S - L): a left-padded row gets another row's positions (mlx-lm's
    # own BatchGenerator has the same fault)
    "afm7": "its KV-reuse layers place a row's queries by the cache buffer's length, not by "
            "the row's own offset",
    # a window one wider than the RotatingKVCache it makes: alone, the cache is the window; a
    # batch keeps whole histories and applies the mask's
    "plamo3": "its sliding layers' mask is one position wider than their cache, which a batch, "
              "keeping each row's whole history, would apply",
    # np.arange(cache[0].offset, ...): one position for every row
    "gpt_bigcode": "its positions come from one cache offset, not from each row's own",
}


def batchable(model) -> bool:
    """Whether every layer mlx-lm makes for `model` (a target or a draft) batches here (inside
    a CacheList too): a plain KVCache, a sliding window, or the recurrent state of a family
    tested here (GATED_DELTANET, REPLAYED_BY_LENGTH); and at least one attention layer, unless
    the family has none (RECURRENT_ONLY); never a family whose code cannot share a batch
    (UNBATCHABLE)."""
    name = model_type(model)
    if name in UNBATCHABLE:
        return False
    layers = make_prompt_cache(model)
    recurrent_ok = name in GATED_DELTANET + REPLAYED_BY_LENGTH + RECURRENT_ONLY
    kinds = {"attention" if type(layer) is KVCache or _sliding(layer)
             else "recurrent" if type(layer) is ArraysCache and recurrent_ok else "other"
             for layer in leaves(layers)}  # (Falcon-H1: a CacheList of both a layer)
    return "other" not in kinds and ("attention" in kinds or name in RECURRENT_ONLY) \
        and not masks_from_an_unwritten_layer(model)


UNWRITTEN = "_mlx_spec_unwritten_first"  # on a model: what `masks_from_an_unwritten_layer` found


def masks_from_an_unwritten_layer(model) -> bool:
    """Whether the first attention layer mlx-lm makes for `model` is one its attention never
    writes (Nemotron-NAS's linear attention, whose KVCache stays empty) while others are
    written: such a model makes every layer's mask from its first cache (create_attention_mask
    (h, cache[0])), which in a batch would know no row's length or padding. Probed once per
    model, one token on a cache of its own; a row alone (solo.py) takes it."""
    found = getattr(model, UNWRITTEN, None)
    if found is None:
        layers = make_prompt_cache(model)
        attention = [layer for layer in leaves(layers) if type(layer) is KVCache]
        found = False
        if len(attention) > 1:
            model(mx.array([[0]]), cache=layers)
            found = attention[0].keys is None and any(a.keys is not None for a in attention)
        object.__setattr__(model, UNWRITTEN, found)  # (not a parameter)
    return found


def _groups_queries(model) -> bool:
    """Whether `model`'s attention groups its queries by key head (GROUPED_QUERIES, more query
    heads than key heads: its `repeats`)."""
    if model_type(model) not in GROUPED_QUERIES:
        return False
    args = model.args
    return args.num_attention_heads > args.num_key_value_heads


def recurrent(model) -> bool:
    """Whether any layer mlx-lm makes for `model` holds recurrent state (ArraysCache)."""
    return any(isinstance(layer, ArraysCache) for layer in leaves(make_prompt_cache(model)))


def _sliding(layer) -> bool:
    """A sliding window with no kept prefix (attention sinks would need a mask of their own)."""
    return type(layer) is RotatingKVCache and layer.keep == 0


def row_cache(model) -> list:
    """A fresh one-row cache list in the batch's kinds: a KVCache for every attention layer,
    sliding-window ones too (their history whole, the window the mask's), and mlx-lm's own
    recurrent state."""
    return [_row_layer(layer) for layer in make_prompt_cache(model)]


def leafwise(convert: Callable) -> Callable:
    """`convert` applied to a layer, or to each leaf of a CacheList (Falcon-H1's), the
    CacheList rebuilt around them."""
    def apply(layer, *args):
        if isinstance(layer, CacheList):
            return CacheList(*(apply(leaf, *args) for leaf in layer.caches))
        return convert(layer, *args)
    return apply


@leafwise
def _row_layer(layer):
    return KVCache() if type(layer) is KVCache or _sliding(layer) else layer


class RowsKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache that knows (from BatchCache, which keeps the rows' padding on
    the host) when no row has left padding: a batch of one, or rows of one length. Its mask is
    then what a one-row KVCache's is (none for one query, "causal" for more, within a sliding
    window's reach), so a row alone runs the attention a call runs."""

    unpadded = False
    grouped = False  # its model's queries grouped by key head: the mask takes an axis (grouped)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if self.unpadded and not return_array and (window_size is None
                                                   or self._idx + N <= window_size):
            return None if N == 1 else "causal"
        return grouped(self, super().make_mask(N, return_array=return_array,
                                               window_size=window_size, **kwargs))


def grouped(layer, mask):
    """A batch's mask (B, 1, L, S) for `layer`, with an axis for the repeats (B, 1, 1, L, S)
    where its model groups queries by key head (GROUPED_QUERIES): broadcast against scores
    (B, kv heads, repeats, L, S), the batch axis stays the batch's."""
    if getattr(layer, "grouped", False) and isinstance(mask, mx.array) and mask.ndim == 4:
        return mask[:, :, None]
    return mask


@leafwise
def _merged(layer):
    """One row's prefilled layer (a KVCache or recurrent state) in the batch's kinds."""
    if isinstance(layer, ArraysCache):
        return ArraysCache.merge([layer])
    merged = RowsKVCache([0])
    if layer.keys is not None and layer.offset:
        n = layer.offset
        merged.keys, merged.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        merged.offset, merged._idx = mx.array([n]), n
    return merged


class BatchCache:
    """The layers of one model for every row, and each row's left padding on the host (none
    where there is no attention layer)."""

    def __init__(self, model):
        self.model = model
        # RowsKVCache and ArraysCache (CacheLists of them: Falcon-H1); None: no rows yet
        self.layers: Optional[list] = None
        self._padding: List[int] = []
        self._snapshot: Optional[list] = None  # recurrent states before the last forward
        self._mixers: Optional[MixerReplay] = None
        self.split = None  # (trunk, head) when an MTP head needs the hidden states
        self.hidden: Optional[mx.array] = None  # (B, T, H) of the last forward, with `split`
        # (x, layers) -> (logits, hidden): a DFlash drafter's taps, as `hidden` (B, T, taps * H)
        self.capture = None
        self.grouped = _groups_queries(model)  # (its attention layers' masks: `grouped`)

    @property
    def padding(self) -> List[int]:
        """Each row's left padding, in every attention layer."""
        return self._padding

    @padding.setter
    def padding(self, padding: List[int]) -> None:
        self._padding = padding
        for layer in self.attention if self.layers is not None else ():
            layer.unpadded = not any(padding)

    @property
    def attention(self) -> List[BatchKVCache]:
        return [layer for layer in leaves(self.layers) if isinstance(layer, BatchKVCache)]

    @property
    def recurrent(self) -> List[ArraysCache]:
        return [layer for layer in leaves(self.layers) if isinstance(layer, ArraysCache)]

    def forward(self, x: mx.array, undoable: bool = True) -> mx.array:
        """The model over x (B, T), lazily; recurrent layers keep where they started, unless
        nothing of it will be taken back (`undoable=False`: a plain step, every row keeping its
        one position: no recording of the mixers' inputs)."""
        if not undoable:
            self._snapshot = None
            return self._run(x)
        with self.undoable(x.shape[1]):
            return self._run(x)

    @contextmanager
    def undoable(self, length: int):
        """A forward of `length` positions per row inside may be taken back by `keep`:
        recurrent layers keep the states they start from (references: free) and record their
        mixers' inputs (nothing to do where there are none)."""
        recurrent = self.recurrent
        if not recurrent:
            yield
            return
        if self._mixers is None or self._mixers.recurrent != recurrent:
            self._mixers = MixerReplay(self.model, recurrent)
        self._snapshot = [list(layer.cache) for layer in recurrent]
        per_row = [a for layer in self.attention for a in (layer.offset, layer.left_padding)]
        with self._mixers.recording(length, per_row):
            yield

    def states(self) -> list:
        """The recurrent layers' states as they stand (references), for `pick_states`."""
        return [list(layer.cache) for layer in self.recurrent]

    def pick_states(self, states: Sequence[list], kept: Sequence[int]) -> None:
        """Row i's recurrent state becomes its own in `states[kept[i]]` (a list of `states()`
        taken after successive one-position forwards: a draft's chain). Exact, with no replay."""
        if all(n == len(states) - 1 for n in kept):
            return  # every row keeps the last: the state as it stands
        if len(set(kept)) == 1:  # every row keeps as many (a row alone): that state, no gather
            for layer, state in zip(self.recurrent, states[kept[0]]):
                layer.cache = list(state)
            return
        index, rows = mx.array(list(kept)), mx.arange(len(kept))
        for j, layer in enumerate(self.recurrent):
            layer.cache = [None if states[-1][j][c] is None else
                           mx.stack([s[j][c] for s in states])[index, rows]
                           for c in range(len(layer.cache))]

    def _run(self, x: mx.array) -> mx.array:
        if self.capture is not None:
            logits, self.hidden = self.capture(x, self.layers)
            return logits
        if self.split is None:
            return self.model(x, cache=self.layers)
        trunk, head = self.split
        self.hidden = trunk(x, cache=self.layers)  # (B, T, H)
        return head(self.hidden)

    @property
    def rows(self) -> int:
        return len(self.padding)

    def join(self, row_layers: Sequence[KVCache]) -> None:
        """Add one row: its own prefilled cache list (it may hold any number of tokens)."""
        merged = [_merged(layer) for layer in row_layers]
        if self.layers is None:
            self.layers = merged
            for layer in self.attention:
                layer.grouped = self.grouped
            self.padding = [0]
            return
        if not self.attention:  # recurrent state alone (pure Mamba): a state a row, no padding
            for layer, new in zip(self.layers, merged):
                layer.extend(new)
            self.padding = self.padding + [0]
            return
        # The lengths are read off an attention layer the model writes (a layer whose attention
        # ignores its cache, Nemotron-NAS's linear ones, holds nothing: no keys)
        attention, incoming = self.attention, [layer for layer in leaves(row_layers)
                                               if isinstance(layer, KVCache)]
        ref = next((i for i, (old, new) in enumerate(zip(attention, incoming))
                    if old.keys is not None or new.keys is not None), 0)
        length, before = incoming[ref].offset, attention[ref]._idx
        for layer, new in zip(self.layers, merged):
            layer.extend(new)
        after = attention[ref]._idx  # the old rows were padded on the left by after - before
        self.padding = [p + after - before for p in self.padding] + [after - length]

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
        attention = self.attention
        for layer in attention:
            if common:
                layer.trim(common)
        self._roll([r - common for r in rejected])
        if any(rejected) and self._snapshot is not None:
            for layer, slots in zip(self.recurrent, self._snapshot):
                layer.cache = list(slots)
            self._mixers.replay_rows(kept)  # lazy too
        self._snapshot = None
        if min(self.padding) >= COMPACT_AT:
            self._compact(min(self.padding))

    def align(self, lengths: Sequence[int]) -> None:
        """After a forward of rows of these lengths, right-padded to the longest: roll each row
        right by its padding, so that its entries end where the others' do (the padding
        becomes left padding; the mask only reads left padding, so the forward needs none)."""
        self._roll([max(lengths) - n for n in lengths])

    def _roll(self, rest: Sequence[int]) -> None:
        """Roll each row right by its `rest` entries (lazy); they join its left padding."""
        if any(rest) and self.attention:  # (no attention layer: nothing to align)
            for layer in self._written:
                layer.prepare(right_padding=list(rest))
                layer.finalize()
            self.padding = [p + r for p, r in zip(self.padding, rest)]

    def tree_pass(self, trees: Sequence[Sequence[int]], ancestors: mx.array, steps: mx.array):
        """A forward of the rows' flattened trees inside this block (batch/trees.py): every
        attention layer's mask each row's tree mask (`tree_mask`, shaped for grouped queries),
        each node rotated at its row's offset + its depth (`steps` (B, N))."""
        return tree_forward(self.attention, steps, lambda layer, window: grouped(
            layer, tree_mask(layer, ancestors, steps, window)[:, None]))  # (B, 1, N, K)

    def keep_paths(self, fed: int, kept_rows: Sequence[Sequence[int]],
                   kept: Sequence[int]) -> None:
        """After a tree pass of `fed` positions: row b keeps its first `kept[b]` nodes of
        `kept_rows[b]` (the root, then its accepted path), gathered to the front of its `fed`
        entries, the rest dropped (`keep`)."""
        if any(list(r) != list(range(len(r))) for r in kept_rows):
            order = [list(r) + [j for j in range(fed) if j not in set(r)] for r in kept_rows]
            index = mx.array(order)[:, None, :, None]  # (B, 1, N, 1)
            for layer in self._written:
                start, end = layer._idx - fed, layer._idx
                for name in ("keys", "values"):
                    a = getattr(layer, name)
                    tail = a[..., start:end, :]
                    a[..., start:end, :] = mx.take_along_axis(
                        tail, mx.broadcast_to(index, tail.shape), axis=2)
        self.keep(fed, kept)

    @property
    def _written(self) -> List[BatchKVCache]:
        """The attention layers holding entries (not one whose attention ignores its cache)."""
        return [layer for layer in self.attention if layer.keys is not None]

    def _compact(self, n: int) -> None:
        for layer in self._written:
            layer.keys = layer.keys[..., n:, :]
            layer.values = layer.values[..., n:, :]
            layer._idx -= n
            layer.left_padding = layer.left_padding - n
        self.padding = [p - n for p in self.padding]

    def extract(self, row: int) -> List[KVCache]:
        """Row `row`'s entries as an ordinary one-row cache list (for the prompt-cache store)."""
        return [leafwise(self._extract)(layer, row) for layer in self.layers]

    def _extract(self, layer, row: int):
        if isinstance(layer, ArraysCache):
            state = ArraysCache(len(layer.cache))  # (None: nothing fed yet, as a KVCache's)
            state.cache = [None if c is None else c[row:row + 1] for c in layer.cache]
            return state
        cache = KVCache()
        if layer.keys is None:  # nothing fed yet (a draft that waits for its prompt)
            return cache
        start = self.padding[row]
        cache.keys = mx.contiguous(layer.keys[row:row + 1, :, start:layer._idx])
        cache.values = mx.contiguous(layer.values[row:row + 1, :, start:layer._idx])
        cache.offset = layer._idx - start
        return cache


def tree_mask(layer, ancestors: mx.array, steps: mx.array,
              window_size: Optional[int] = None) -> mx.array:
    """(B, N, K) bool over the K = entries + N keys a BatchKVCache returns: row b's node i
    sees a key past the row's left padding that a query at its depth decoded alone would see
    (cache/window.py's `visible`, the one window rule) and that is the context's or one of its
    own ancestors. Positions are buffer indices (each row's position plus its left padding)."""
    rows, n = steps.shape
    context = mx.broadcast_to(mx.arange(layer._idx)[None], (rows, layer._idx))
    nodes = layer._idx + steps  # (B, N)
    keys = mx.concatenate([context, nodes], axis=1)  # (B, K)
    seen = visible(nodes, keys, window_size) & (keys >= layer.left_padding[:, None])[:, None]
    return seen & mx.concatenate([mx.ones((rows, n, layer._idx), mx.bool_), ancestors], axis=-1)


def arrays(layers) -> list:
    """Every array a cache list holds (to evaluate it)."""
    out = []
    for layer in leaves(layers):
        if isinstance(layer, ArraysCache):
            values = layer.cache
        elif hasattr(layer, "keys"):
            values = (layer.keys, layer.values)
        else:  # (another kind, a row alone's: deepseek_v41's LayerCache)
            values = [v for _, v in tree_flatten(layer.state)]
        out += [v for v in values if v is not None]
    return out
