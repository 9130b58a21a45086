"""One model's cache, rewindable to any point of the current round, for every cache kind.

The loop marks an anchor before each forward it may have to undo
(`anchor()`), feeds tokens (`forward`), and after verification keeps a prefix
of what it fed (`keep`). How a layer goes back depends on its kind:

- attention caches (`KVCache`, quantized, chunked, `WindowKVCache`): trim the
  offset (host metadata only);
- recurrent state (`ArraysCache`: Gated DeltaNet, Mamba, short convolutions):
  the layer's slots are snapshotted by reference at the anchor (the layers
  assign new arrays, so this is free). Going back restores them and replays
  the kept tokens. A replay is a lazy forward of the kept tokens evaluated
  with the next round's sync, so rejections cost one extra (short) forward
  and full acceptance costs nothing.

`checkpoint()` / `restore()` also give exact per-step states for free where
the caller feeds one token at a time (the draft model's steps). Given
`split=(trunk, head)`, `forward` also keeps the hidden states it computed
(`hidden`), for an MTP drafter; the logits are the same computation.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from .replay import MixerReplay
from .window import DEFAULT_RESERVE, WindowKVCache


def leaves(layers: Sequence) -> Iterator:
    """Every leaf cache, looking inside mlx-lm's CacheList."""
    for layer in layers:
        if isinstance(layer, CacheList):
            yield from leaves(layer.caches)
        else:
            yield layer


def is_recurrent(layer) -> bool:
    return isinstance(layer, ArraysCache)


def is_trimmable(layer) -> bool:
    return hasattr(layer, "trim") and layer.is_trimmable() and not is_recurrent(layer)


# Attributes a call leaves on a caller's layer (session.py): they follow the layer when it is
# replaced by its other kind.
MARK = "_mlx_spec_"


def _replace(layers: list, convert: Callable) -> int:
    """In place, inside CacheList too: each leaf becomes `convert(leaf)` where that is not None.
    Returns how many were replaced."""
    replaced = 0
    for i, layer in enumerate(layers):
        if isinstance(layer, CacheList):
            caches = list(layer.caches)
            n = _replace(caches, convert)
            if n:
                layer.caches = type(layer.caches)(caches)  # (a tuple, as mlx-lm builds it)
            replaced += n
            continue
        new = convert(layer)
        if new is not None:
            layers[i] = _marked(layer, new)
            replaced += 1
    return replaced


def _marked(old, new):
    """`new`, carrying the attributes mlx-spec keeps on `old` (MARK: a prompt cache's owner,
    tokens, context)."""
    for key, value in getattr(old, "__dict__", {}).items():
        if key.startswith(MARK):
            setattr(new, key, value)
    return new


def make_rewindable(layers: list, reserve: int = DEFAULT_RESERVE) -> None:
    """Replace sliding-window layers by rewindable ones, in place (the list stays the caller's)."""
    def convert(layer):
        if isinstance(layer, RotatingKVCache):
            return WindowKVCache.from_rotating(layer, reserve)
        if isinstance(layer, WindowKVCache) and layer.reserve < reserve:
            layer.reserve = reserve
        return None
    _replace(layers, convert)


def make_plain(layers: list) -> int:
    """The inverse of make_rewindable, in place: every WindowKVCache becomes mlx-lm's
    RotatingKVCache holding the same tokens (lazily), so the list is mlx-lm's own again
    (save_prompt_cache / load_prompt_cache, mlx-lm's generation). Returns how many."""
    return _replace(layers, lambda layer: layer.to_rotating()
                    if isinstance(layer, WindowKVCache) else None)


def unsupported_kinds(layers: Sequence) -> List[str]:
    """Cache kinds this module cannot rewind (none that mlx-lm builds for one sequence)."""
    return sorted({type(c).__name__ for c in leaves(layers)
                   if not (is_recurrent(c) or isinstance(c, (WindowKVCache, RotatingKVCache))
                           or (hasattr(c, "trim") and hasattr(c, "offset")))})


def cache_length(layers) -> int:
    """Tokens held, read from the first layer that counts them (recurrent state does not)."""
    for layer in leaves(layers):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


@dataclass
class Checkpoint:
    length: int
    slots: List[list]  # per recurrent layer, its slot arrays at that point


class ModelCache:
    """A model and its cache list; `length` counts the tokens the cache holds."""

    def __init__(self, model, layers: list, length: Optional[int] = None,
                 rewindable: bool = True, reserve: int = DEFAULT_RESERVE,
                 split: Optional[tuple] = None, capture: Optional[Callable] = None):
        if rewindable:  # sliding windows become WindowKVCache, in `layers` itself
            make_rewindable(layers, reserve)
        self.model = model
        self.layers = layers
        self.length = cache_length(layers) if length is None else length
        all_leaves = list(leaves(layers))
        self.trimmable = [c for c in all_leaves if not is_recurrent(c)]
        self.recurrent = [c for c in all_leaves if is_recurrent(c)]
        self._anchor: Optional[Checkpoint] = None
        self._fed = []  # tokens fed since the anchor, when known: host ids or a lazy array
        self._record = False  # record the next forward's recurrent mixers
        self._recent = deque(maxlen=4)  # checkpoints before the latest forwards (recurrent only)
        self.mixers = MixerReplay(model, self.recurrent) if self.recurrent else None
        self.replayed_tokens = 0  # tokens re-run to rebuild recurrent state
        self.rewind_path = "trim" if not self.recurrent else None  # "mixers" or "model" once used
        # Hidden states for an MTP drafter: with split = (trunk, head), where
        # head(trunk(x)) is the model's own computation, `forward` keeps the
        # trunk's output in `hidden` (the logits are unchanged). None: no cost.
        # A block drafter's taps: capture(tokens (1, T), layers) -> (logits (1, T, V), taps
        # (1, T, X)), the model's own forward with chosen layer outputs kept on the side
        # (dflash/taps.py tap_capture, a batch's too); `hidden` keeps the row (T, X).
        # With both (the prompt look on a block drafter's target) the trunk's output of the last
        # forward is kept in `final`, the taps in `hidden`.
        self.split = split
        self.capture = capture
        self.hidden: Optional[mx.array] = None  # (T, H) of the last forward, lazy
        self.final: Optional[mx.array] = None

    @property
    def has_recurrent(self) -> bool:
        return bool(self.recurrent)

    def forward(self, tokens: mx.array, embeddings: Optional[mx.array] = None) -> mx.array:
        """Feed `tokens` (T,), lazily; returns the logits (T, V). `embeddings` (T, H): fed in
        place of the tokens' own (mlx-lm's input_embeddings; plain models only)."""
        if embeddings is not None:
            logits = self.model(tokens[None], cache=self.layers, input_embeddings=embeddings[None])[0]
            self.length += tokens.shape[0]
            return logits
        if self.recurrent:
            self._recent.append(self.checkpoint())
        if self._record:  # the first forward after anchor(): note the recurrent mixers' inputs
            self._record = False
            with self.mixers.recording(tokens.shape[0]):
                logits = self._run(tokens)
        else:
            if self.mixers is not None:  # recordings hold only for the forward they saw
                self.mixers.calls.clear()
            logits = self._run(tokens)
        self.length += tokens.shape[0]
        return logits

    def _run(self, tokens: mx.array) -> mx.array:
        if self.capture is not None and self.split is not None:
            trunk, head = self.split
            final, taps = self.capture(tokens[None], self.layers, forward=trunk)
            self.final, self.hidden = final[0], taps[0]
            return head(final)[0]
        if self.capture is not None:
            logits, taps = self.capture(tokens[None], self.layers)
            self.hidden = taps[0]
            return logits[0]
        if self.split is None:
            return self.model(tokens[None], cache=self.layers)[0]
        trunk, head = self.split
        hidden = trunk(tokens[None], cache=self.layers)  # (1, T, H)
        self.hidden = hidden[0]
        return head(hidden)[0]

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.length, [list(c.cache) for c in self.recurrent])

    def restore(self, point: Checkpoint) -> None:
        """Go back to `point` (no replay): trim attention, put the recurrent slots back."""
        for layer in self.trimmable:  # by each layer's own count: others may have fed it too
            if layer.offset >= point.length:
                layer.trim(layer.offset - point.length)
            else:  # forward again to a later checkpoint whose entries are still there
                _untrim(layer, point.length - layer.offset)
        for layer, slots in zip(self.recurrent, point.slots):
            layer.cache = list(slots)
        self.length = point.length

    def restore_length(self, length: int) -> None:
        """Go back to `length` tokens; only attention layers can without a checkpoint."""
        if length < self.length:
            if self.recurrent:
                raise RuntimeError("recurrent state can only go back to a checkpoint")
            self._trim(self.length - length)
            self.length = length

    def anchor(self) -> None:
        """Mark the point the next forwards may be undone back to."""
        self._anchor = self.checkpoint()
        self._fed = []
        self._record = self.mixers is not None

    @property
    def anchor_length(self) -> int:
        return self._anchor.length

    def fed(self, tokens) -> None:
        """Tell the cache the tokens fed since the anchor: host values, or the lazy (T,) array
        fed (a replay of the whole model then reads it lazily)."""
        self._fed = tokens if isinstance(tokens, mx.array) else list(tokens)

    def keep(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` fed since the anchor."""
        anchor = self._anchor
        drop = self.length - anchor.length - num_tokens
        if drop <= 0:
            return
        if not self.recurrent:
            self._trim(drop)
            self.length -= drop
        else:
            fed = self.length - anchor.length
            if self.mixers.complete and fed <= self.mixers.length:  # a prefix of the recorded
                # Only the recurrent mixers run again, on the kept prefix of their inputs.
                self._trim(drop)
                for layer, slots in zip(self.recurrent, anchor.slots):
                    layer.cache = list(slots)
                if num_tokens:
                    self.mixers.replay(num_tokens)
                self.length -= drop
                self.rewind_path = "recurrence" if self.mixers.recurrence_only == len(
                    self.recurrent) else "mixers"
            else:  # the whole model runs again over the kept tokens
                if len(self._fed) != fed:
                    raise RuntimeError("keep() needs the host values of every token fed since anchor()")
                kept = self._fed[:num_tokens]
                self.restore(anchor)
                if len(kept):
                    self.forward(kept if isinstance(kept, mx.array) else mx.array(kept, mx.uint32))
                self.rewind_path = "model"
            self.replayed_tokens += num_tokens
        self._fed = self._fed[:num_tokens]

    def peek(self, length: int) -> Optional[Callable[[], None]]:
        """Show only the first `length` tokens until the returned undo is called.

        Attention layers are trimmed; recurrent state is rebuilt lazily by the
        recorded mixers (never evaluated unless the cache is used before the
        undo). None when that cannot be done cheaply (state left as is).
        """
        n = self.length - length
        if n <= 0 or any(isinstance(c, RotatingKVCache) or not hasattr(c, "trim")
                         for c in self.trimmable):
            return None  # (a ring that wrapped, or a kind with no trim: left as is)
        point = self.point_at(length)
        if point is not None:  # a checkpoint of exactly that length (e.g. before a plain step)
            after = self.checkpoint()
            self.restore(point)
            return lambda: self.restore(after)
        if self.recurrent:
            anchor = self._anchor
            if (anchor is None or length < anchor.length or not self.mixers.complete
                    or self.length - anchor.length > self.mixers.length):
                return None
            after = self.checkpoint()
            for layer, slots in zip(self.recurrent, anchor.slots):
                layer.cache = list(slots)
            if length > anchor.length:
                self.mixers.replay(length - anchor.length)
        self._trim(n)
        self.length -= n

        def undo():
            self.untrim(n)
            for layer, slots in zip(self.recurrent, after.slots if self.recurrent else []):
                layer.cache = list(slots)
        return undo

    def look_ahead(self, tokens: mx.array) -> Callable[[], None]:
        """Feed `tokens` for show until the returned undo is called.

        The forward is lazy and the undo puts every layer's attributes back by
        reference (arrays, offsets, recurrent slots), so what was fed is never
        computed unless something reads the cache before the undo.
        """
        saved = [(layer, {key: _handle(value) for key, value in vars(layer).items()})
                 for layer in leaves(self.layers)]
        length, recent, hidden, record = self.length, list(self._recent), self.hidden, self._record
        calls = dict(self.mixers.calls) if self.mixers is not None else None
        self._record = False
        self.forward(tokens)

        def undo():
            for layer, state in saved:
                vars(layer).clear()
                vars(layer).update(state)
            self.length, self.hidden, self._record = length, hidden, record
            self._recent = deque(recent, maxlen=self._recent.maxlen)
            if calls is not None:
                self.mixers.calls = calls
        return undo

    def quantize(self, group_size: int, bits: int) -> dict:
        """mlx-lm's KV quantization: every plain KVCache layer (at the top of the list) becomes
        its QuantizedKVCache (`to_quantized`), in `layers` itself, carrying what mlx-spec keeps
        on a layer (`_marked`). Returns {id(old layer): new layer}, for other lists holding
        the same layers."""
        replaced = {}
        for i, layer in enumerate(self.layers):  # (as mlx-lm: not inside a CacheList)
            if type(layer) is KVCache:
                self.layers[i] = replaced[id(layer)] = _marked(
                    layer, layer.to_quantized(group_size=group_size, bits=bits))
        self.trimmable = [c for c in leaves(self.layers) if not is_recurrent(c)]
        return replaced

    def point_at(self, length: int) -> Optional[Checkpoint]:
        """A recent checkpoint holding exactly `length` tokens (recurrent caches only)."""
        return next((p for p in reversed(self._recent) if p.length == length), None)

    def _trim(self, n: int) -> None:
        if n > 0:
            for layer in self.trimmable:
                layer.trim(n)

    def untrim(self, n: int) -> None:
        """Take back a trim of attention entries that were not overwritten since."""
        for layer in self.trimmable:
            _untrim(layer, n)
        self.length += n


def _handle(value):
    """A copy of the references in `value` that later in-place writes do not reach: a
    `copy.copy(a)` is the same array (no operation, no data copied), but the updates
    `a[...] = x` makes to the object `a` do not reach it."""
    if isinstance(value, mx.array):
        return copy.copy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_handle(v) for v in value)
    return value


def _untrim(layer, n: int) -> None:
    if isinstance(layer, WindowKVCache):
        layer.untrim(n)
    else:
        layer.offset += n
