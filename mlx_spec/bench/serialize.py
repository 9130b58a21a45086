"""Saved bench results back into dataclasses, so a report can be re-rendered from its JSON.

`BenchResult.as_dict()` writes plain JSON (dict keys become strings, tuples
become lists); `from_dict(BenchResult, data)` walks the type hints to undo
that.
"""

from __future__ import annotations

import dataclasses
import typing


def from_dict(cls, data):
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: _decode(hints[f.name], data[f.name])
              for f in dataclasses.fields(cls) if f.name in data}
    return cls(**kwargs)


def _decode(tp, value):
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value) if len(inner) == 1 else value
    if origin in (list, typing.List) or origin is getattr(typing, "Sequence", None) or (
            origin is not None and origin.__name__ == "Sequence"):
        return [_decode(args[0], v) for v in value] if args else list(value)
    if origin is tuple:
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value))
    if origin is dict:
        key_type, value_type = args if args else (str, typing.Any)
        return {_decode(key_type, k): _decode(value_type, v) for k, v in value.items()}
    if tp is tuple:
        return tuple(value)
    if tp is list:
        return list(value)
    if tp is int:
        return int(value)
    if tp is float:
        return float(value)
    return value
