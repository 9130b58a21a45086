"""Rebuild recurrent state after a partial accept by re-running only the recurrent mixers.

During a recorded forward, every module call that receives a watched
`ArraysCache` is noted (the innermost one is the mixer that owns the state:
a Gated DeltaNet, a Mamba-2 mixer, a short convolution), with its inputs.
Keeping m of the T fed tokens then means: put the state back as it was
before the forward and call each mixer again on the first m positions of
its recorded inputs. Attention layers, MLPs and the output head are not
re-run, and the replay stays lazy (it is evaluated with the next round).

Recording patches the `__call__` of the model's module classes that take a
`cache` argument, only for the duration of that one forward.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
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
        self.calls: Dict[int, Tuple[object, tuple, dict]] = {}
        self.length: Optional[int] = None  # T of the recorded forward

    @contextmanager
    def recording(self, length: int):
        self.calls = {}
        self.length = length
        watched = {id(c) for c in self.recurrent}
        saved = [(cls, cls.__dict__.get("__call__")) for cls in self.classes]
        calls = self.calls

        def wrap(original):
            def __call__(module, *args, **kwargs):
                for value in list(args) + list(kwargs.values()):
                    if isinstance(value, ArraysCache) and id(value) in watched:
                        calls[id(value)] = (module, args, kwargs)  # innermost call wins
                return original(module, *args, **kwargs)
            return __call__

        try:
            for cls, _ in saved:
                cls.__call__ = wrap(cls.__call__)
            yield
        finally:
            for cls, own in saved:
                if own is None:
                    del cls.__call__
                else:
                    cls.__call__ = own

    @property
    def complete(self) -> bool:
        """Every recurrent cache was seen (else the caller replays the whole model)."""
        return all(id(c) in self.calls for c in self.recurrent)

    def replay(self, num_tokens: int) -> None:
        """Re-run each recorded mixer on the first `num_tokens` positions (state must be reset)."""
        for cache in self.recurrent:
            module, args, kwargs = self.calls[id(cache)]
            type(module).__call__(module, *self._prefix(args, num_tokens),
                                  **dict(zip(kwargs, self._prefix(kwargs.values(), num_tokens))))

    def _prefix(self, values, num_tokens: int) -> List:
        """Sequence-shaped arrays (B, T, ...) cut to their first `num_tokens` positions."""
        out = []
        for value in values:
            if isinstance(value, mx.array) and value.ndim >= 2 and value.shape[1] == self.length:
                value = value[:, :num_tokens]
            out.append(value)
        return out
