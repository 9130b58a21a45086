"""Rebuild recurrent state after a partial accept by re-running only the recurrent mixers.

During a recorded forward, every module call that receives a watched
`ArraysCache` is noted with its inputs; a call inside which another call
took the same cache (a decoder layer handing it on) is dropped, so what stays
are the mixers that own the state (a Gated DeltaNet, a Mamba-2 mixer, a short
convolution; RWKV-7's time mix and channel mix, which share one cache, both,
in order). Keeping m of the T fed tokens then means: put the state back as it
was before the forward and call each mixer again on the first m positions of
its recorded inputs. Attention layers, MLPs and the output head are not
re-run, and the replay stays lazy (it is evaluated with the next round).

Gated DeltaNet layers (qwen3_5, qwen3_next) go further: the recording also
keeps each layer's convolution input and the inputs of its `gated_delta_update`
call, so the replay is the recurrence alone over the kept steps plus a slice of
the convolution input -- no projection is re-run.

Recording patches the `__call__` of the model's module classes that take a
`cache` argument (and `nn.Conv1d`, and the modules' `gated_delta_update`), only
for the duration of that one forward.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache


_CLASSES: Dict[type, list] = {}  # model class -> its module classes that take a cache


def _cache_taking_classes(model) -> list:
    key = type(model)
    if key not in _CLASSES:
        _CLASSES[key] = sorted({type(m) for _, m in model.named_modules() if _takes_cache(type(m))},
                               key=lambda c: c.__qualname__)
    return _CLASSES[key]


def _takes_cache(cls) -> bool:
    try:
        return "cache" in inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):
        return False


class MixerReplay:
    """Records which module updates each recurrent cache, and replays it over a prefix."""

    def __init__(self, model, recurrent: Sequence[ArraysCache]):
        self.recurrent = list(recurrent)
        self.classes = _cache_taking_classes(model)
        # id(cache) -> the mixers' calls that took it, in order: (module, args, kwargs)
        self.calls: Dict[int, List[Tuple[object, tuple, dict]]] = {}
        self.length: Optional[int] = None  # T of the recorded forward
        self.conv_inputs: Dict[int, mx.array] = {}  # id(conv module) -> its input
        self.recurrences: Dict[int, Tuple] = {}  # id(state in) -> (function, args, kwargs)
        self.recurrence_only = 0  # layers replayed by their recurrence alone, last replay
        self.per_row: List[mx.array] = []  # arrays of a value a row, as the forward began

    @contextmanager
    def recording(self, length: int, per_row: Sequence[mx.array] = ()):
        """Record the mixers' calls of a forward of `length` positions; `per_row`: a batch's
        arrays of a value a row (its attention layers' offsets, as the forward began), which
        a model may hand its mixers (Bailing's rotary offsets) and a replay cuts by row."""
        self.calls = {}
        self.length = length
        self.per_row = list(per_row)  # (held: their ids stay theirs)
        watched = {id(c) for c in self.recurrent}
        saved = [(cls, cls.__dict__.get("__call__")) for cls in self.classes]
        calls = self.calls
        under_way: List[Tuple[int, tuple]] = []  # (id(cache), call) of the calls not returned

        def wrap(original):
            def __call__(module, *args, **kwargs):
                taken = list(dict.fromkeys(  # (each once, however often it is passed)
                    id(value) for value in list(args) + list(kwargs.values())
                    if isinstance(value, ArraysCache) and id(value) in watched))
                if not taken:
                    return original(module, *args, **kwargs)
                call = (module, args, kwargs)
                for cache, outer in under_way:  # it hands the cache on: not a mixer
                    if cache in taken and any(c is outer for c in calls.get(cache, ())):
                        calls[cache] = [c for c in calls[cache] if c is not outer]
                for cache in taken:
                    calls.setdefault(cache, []).append(call)
                    under_way.append((cache, call))
                try:
                    return original(module, *args, **kwargs)
                finally:
                    del under_way[-len(taken):]
            return __call__

        try:
            for cls, _ in saved:
                cls.__call__ = wrap(cls.__call__)
            with self._recording_recurrences():
                yield
        finally:
            for cls, own in saved:
                if own is None:
                    del cls.__call__
                else:
                    cls.__call__ = own

    @contextmanager
    def _recording_recurrences(self):
        """Note Conv1d inputs and gated_delta_update calls (the Gated DeltaNet fast path)."""
        self.conv_inputs, self.recurrences = {}, {}
        modules = {sys.modules[cls.__module__] for cls in self.classes}
        modules = [m for m in modules if callable(getattr(m, "gated_delta_update", None))]
        if not modules:
            yield
            return
        conv_call = nn.Conv1d.__call__
        conv_inputs, recurrences = self.conv_inputs, self.recurrences

        def conv(module, x, *args, **kwargs):
            conv_inputs[id(module)] = x
            return conv_call(module, x, *args, **kwargs)

        originals = [(m, m.gated_delta_update) for m in modules]

        def recorder(function):
            def gated_delta_update(*args, **kwargs):
                state = kwargs["state"] if "state" in kwargs else (args[7] if len(args) > 7 else None)
                if state is not None:
                    recurrences[id(state)] = (function, args, kwargs)
                return function(*args, **kwargs)
            return gated_delta_update

        try:
            nn.Conv1d.__call__ = conv
            for module, function in originals:
                module.gated_delta_update = recorder(function)
            yield
        finally:
            nn.Conv1d.__call__ = conv_call
            for module, function in originals:
                module.gated_delta_update = function

    @property
    def complete(self) -> bool:
        """Every recurrent cache was seen (else the caller replays the whole model)."""
        return all(self.calls.get(id(c)) for c in self.recurrent)

    def replay(self, num_tokens: int) -> None:
        """Re-run each recorded mixer on the first `num_tokens` positions (state must be reset)."""
        self.recurrence_only = 0
        for cache in self.recurrent:
            calls = self.calls[id(cache)]
            if len(calls) == 1 and self._replay_recurrence(calls[0][0], cache, num_tokens):
                self.recurrence_only += 1
                continue
            for module, args, kwargs in calls:
                type(module).__call__(module, *self._prefix(args, num_tokens), **dict(zip(
                    kwargs, self._prefix(kwargs.values(), num_tokens))))

    def _recurrence_of(self, module, cache):
        """(the recorded recurrence call, its convolution's input) of a Gated DeltaNet layer
        (one `conv1d`, then gated_delta_update on the cache's second entry), or None: a mixer
        replayed whole (Kimi Delta Attention's three convolutions, say)."""
        conv = getattr(module, "conv1d", None)
        call = self.recurrences.get(id(cache[1])) if len(cache.cache) == 2 else None
        conv_input = self.conv_inputs.get(id(conv)) if conv is not None else None
        return None if call is None or conv_input is None else (call, conv_input)

    def _replay_recurrence(self, module, cache, num_tokens: int) -> bool:
        """A Gated DeltaNet layer: slice its conv input, re-run its recurrence alone."""
        found = self._recurrence_of(module, cache)
        if found is None or cache.lengths is not None:
            return False
        (function, args, kwargs), conv_input = found
        args, kwargs = list(args), dict(kwargs)
        if "mask" in kwargs:
            kwargs["mask"] = None
        elif len(args) > 8:
            args[8] = None
        n_keep = conv_input.shape[1] - self.length  # (B, K - 1 + T, C): old state, then new rows
        cache[0] = mx.contiguous(conv_input[:, num_tokens:num_tokens + n_keep])
        _, cache[1] = function(*[a[:, :num_tokens] for a in args[:5]], *args[5:], **kwargs)
        return True

    def replay_rows(self, kept: Sequence[int]) -> None:
        """A batch: row i keeps its first `kept[i]` positions (state must be reset). A Gated
        DeltaNet runs its recurrence alone over the longest prefix, masked past each row's
        own end (its convolution state sliced at that end); another mixer (Mamba-2, a short
        convolution) runs once per distinct kept length, on the rows that keep that many, as
        it would alone (`replay`), and each row's state is gathered back into place."""
        longest = max(kept)
        lengths = mx.array(list(kept))
        mask = mx.arange(longest)[None] < lengths[:, None]  # (B, longest)
        for cache in self.recurrent:
            calls = self.calls[id(cache)]
            found = self._recurrence_of(calls[0][0], cache) if len(calls) == 1 else None
            if found is not None:
                self._replay_recurrence_rows(found, cache, longest, lengths, mask)
            else:
                self._replay_groups(calls, cache, kept)

    def _replay_recurrence_rows(self, found, cache, longest, lengths, mask) -> None:
        (function, args, kwargs), conv_input = found
        n_keep = conv_input.shape[1] - self.length
        positions = (lengths[:, None] + mx.arange(n_keep))[..., None]  # (B, K - 1, 1)
        cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        args, kwargs = list(args), dict(kwargs)
        if "mask" in kwargs:
            kwargs["mask"] = mask
        else:
            args[8] = mask
        _, cache[1] = function(*[a[:, :longest] for a in args[:5]], *args[5:], **kwargs)

    def _replay_groups(self, calls, cache, kept: Sequence[int]) -> None:
        """The mixers (`calls`, in order) once per distinct kept length m, on its rows' states
        and the first m positions of their recorded inputs; the states (batch first, as
        ArraysCache.filter has them) are put back in row order."""
        rows = len(kept)
        order, parts = [], []
        for m in sorted(set(kept)):
            index = [i for i, n in enumerate(kept) if n == m]
            picked = mx.array(index)
            group = ArraysCache(len(cache.cache))
            group.cache = [None if c is None else c[picked] for c in cache.cache]

            def cut(value):
                if value is cache:
                    return group
                if isinstance(value, mx.array) and value.ndim >= 2 and \
                        value.shape[:2] == (rows, self.length):
                    return value[picked, :m]
                if any(value is a for a in self.per_row):
                    return value[picked]
                return value

            for module, args, kwargs in calls:
                type(module).__call__(module, *[cut(a) for a in args],
                                      **{name: cut(v) for name, v in kwargs.items()})
            order += index
            parts.append(group.cache)
        back = mx.argsort(mx.array(order))  # row i's place among the groups' rows
        cache.cache = [None if states[0] is None else mx.concatenate(states)[back]
                       for states in zip(*parts)]

    def _prefix(self, values, num_tokens: int) -> List:
        """Sequence-shaped arrays (B, T, ...) cut to their first `num_tokens` positions."""
        out = []
        for value in values:
            if isinstance(value, mx.array) and value.ndim >= 2 and value.shape[1] == self.length:
                value = value[:, :num_tokens]
            out.append(value)
        return out
