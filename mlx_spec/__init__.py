"""mlx-spec: exact speculative decoding on MLX.

    from mlx_spec import load, generate
    target_model, tokenizer = load("mlx-community/Qwen2.5-7B-Instruct-4bit")
    draft_model, _ = load("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
    text = generate(target_model, tokenizer, "Hello", draft_model=draft_model)

The API mirrors mlx-lm, so code ports by changing an import. With no path,
`load()` / `load_default_pair()` give the small pair shipped in the package.

Importing the package imports no MLX: each name below is imported on first
use, so `mlx-spec --help` starts without loading MLX or mlx-lm.
"""

import sys
import types
from importlib import import_module

__version__ = "0.1.0"

_HOMES = {  # public name -> the module that defines it
    "generate": ".generate",
    "stream_generate": ".generate",
    "speculative_generate_step": ".generate",
    "GenerationResponse": ".generate",
    "batch_generate": ".batch.api",
    "BatchEngine": ".batch.engine",
    "load": ".loading",
    "check_pair": ".loading",
    "SamplingConfig": ".sampling",
    "GenerationStats": ".stats",
    "SuffixIndex": ".drafters.suffix_index",
    "default_suffix_index": ".drafters.suffix",
}


def __getattr__(name):
    """Import a public name from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))


class _Package(types.ModuleType):
    """`mlx_spec.generate` is the function, even after the submodule of that name is imported.

    Importing `mlx_spec.generate` (the module) binds it as the package's
    attribute `generate`; this property keeps the name meaning the function,
    as an eager `from .generate import generate` did.
    """

    @property
    def generate(self):
        return globals().get("generate") or __getattr__("generate")

    @generate.setter
    def generate(self, value):
        if not isinstance(value, types.ModuleType):
            globals()["generate"] = value


sys.modules[__name__].__class__ = _Package


def load_default_pair():
    """Return `(target_model, draft_model, tokenizer)` for the shipped default pair."""
    from .loading import default_draft_path, default_target_path, load

    target_model, tokenizer = load(str(default_target_path()))
    draft_model, _ = load(str(default_draft_path()))
    return target_model, draft_model, tokenizer


__all__ = [
    "load",
    "load_default_pair",
    "generate",
    "stream_generate",
    "speculative_generate_step",
    "batch_generate",
    "BatchEngine",
    "check_pair",
    "GenerationResponse",
    "GenerationStats",
    "SamplingConfig",
    "SuffixIndex",
    "default_suffix_index",
]
