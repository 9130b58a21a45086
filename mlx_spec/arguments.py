"""Checks on what a caller passes to the API: one `ValueError` sentence naming the argument.

`check_arguments(**named)` checks every argument it knows by name and leaves
the others to their owners (`prompt_cache` is checked against the models,
`policy` is internal, `sampling` and `calibration` are checked with
`check_instance` by the modules that define their types). It is pure (no model or device work) and imports no
MLX, so the command line can share its limits. Types are checked as well
as ranges: an int where an int is meant (not 2.5, not True), a real number
in range where a float is meant, a seed MLX accepts (0 <= seed < 2**64), a
prompt that is text, a list of token ids or a 1-D integer array.
"""

from __future__ import annotations

import os
from numbers import Integral, Real
from typing import Callable, Dict, Tuple

SEED_LIMIT = 2**64  # mx.random.seed takes an unsigned 64-bit int
PROMPT_EXPECTED = "a string, a list of token ids (ints) or a 1-D integer array"


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _int(minimum: int, note: str = "") -> Tuple[str, Callable]:
    return f"an int >= {minimum}{note}", lambda v: _is_int(v) and v >= minimum


def _real(interval: str, inside: Callable) -> Tuple[str, Callable]:
    return f"a number in {interval}", lambda v: _is_real(v) and inside(v)


def _optional(check: Tuple[str, Callable]) -> Tuple[str, Callable]:
    expected, test = check
    return f"None or {expected}", lambda v: v is None or test(v)


def _is_model(value) -> bool:
    return callable(value) and hasattr(value, "layers")


def _is_draft(value) -> bool:
    if value is None or isinstance(value, (str, os.PathLike)):  # "mtp" or a drafter's path
        return True
    # a DFlash drafter, an EAGLE-3 head
    return _is_model(value) or hasattr(value, "dflash_config") or hasattr(value, "eagle3_config")


def _is_path(value) -> bool:
    return value is None or isinstance(value, (str, os.PathLike))


_MODEL = ("a model such as load() returns", _is_model)
_TOKENIZER = ("a tokenizer such as load() returns", lambda v: hasattr(v, "encode"))
_FLAG = ("True or False", lambda v: isinstance(v, bool))
_OPTIONAL_FLAG = ("True, False or None", lambda v: v is None or isinstance(v, bool))
_CALLBACK = ("a function", callable)
_SEED = ("an int in [0, 2**64) (MLX's seed range)", lambda v: _is_int(v) and 0 <= v < SEED_LIMIT)

# name -> (what is expected, in words; the test it must pass)
CHECKS: Dict[str, Tuple[str, Callable]] = {
    "model": _MODEL,
    "target_model": _MODEL,
    "draft_model": ('None, a model such as load() returns, a DFlash drafter, an EAGLE-3 head, '
                    'the path of one, or "mtp"', _is_draft),
    "mtp_weights": ("None, a directory or a Hugging Face repo id", _is_path),
    "tokenizer": _TOKENIZER,
    "draft_tokenizer": _optional(_TOKENIZER),
    "target_tokenizer": _optional(_TOKENIZER),
    "max_tokens": ("an int >= 1, or -1 for no limit", lambda v: _is_int(v) and (v >= 1 or v == -1)),
    "num_draft_tokens": _optional(_int(1)),
    "max_draft_tokens": _int(1),
    "prompt_lookup_max_ngram": _int(1),
    "prefill_step_size": _optional(_int(1)),
    "max_kv_size": _optional(_int(1)),
    # mlx-lm's KV cache quantization (mx.quantize's bits and group sizes; cache/quantize.py)
    "kv_bits": ("None or one of 2, 3, 4, 5, 6, 8", lambda v: v is None or (
        _is_int(v) and v in (2, 3, 4, 5, 6, 8))),
    "kv_group_size": ("one of 32, 64, 128", lambda v: _is_int(v) and v in (32, 64, 128)),
    "quantized_kv_start": _int(0),
    "samples": _int(100),
    "temp": ("a number >= 0 (0 is greedy)", lambda v: _is_real(v) and v >= 0),
    "top_p": _real("(0, 1]", lambda v: 0 < v <= 1),
    "top_k": _int(0, " (0 disables top-k)"),
    "min_p": _real("[0, 1)", lambda v: 0 <= v < 1),
    "min_tokens_to_keep": _int(1),
    "xtc_probability": _real("[0, 1]", lambda v: 0 <= v <= 1),  # mlx-lm's XTC sampling
    "xtc_threshold": _real("[0, 0.5]", lambda v: 0 <= v <= 0.5),
    "draft_confidence": _real("[0, 1)", lambda v: 0 <= v < 1),
    "alpha": _real("(0, 1)", lambda v: 0 < v < 1),
    "seed": _optional(_SEED),
    "adaptive": _OPTIONAL_FLAG,
    "prompt_lookup": _OPTIONAL_FLAG,
    # the SuffixIndex type lives above this module: assemble checks the instance
    "suffix": ("None, True, False or a SuffixIndex",
               lambda v: v is None or isinstance(v, bool) or hasattr(v, "longest")),
    "auto_off": _FLAG,
    "tree": ("None (the policy decides), False (chains) or a (depth, width) pair of ints >= 1",
             lambda v: v is None or v is False or (isinstance(v, (tuple, list)) and len(v) == 2
                                                   and all(_is_int(x) and x >= 1 for x in v))),
    "prompt_cache_live": _FLAG,
    "machine": ("None or a MachineRecord (mlx_spec.policy)",
                lambda v: v is None or hasattr(v, "hand_on")),
    "verbose": _FLAG,
    "prompt_progress_callback": _optional(_CALLBACK),
    "accept": _optional(_CALLBACK),
    "sampler": _optional(_CALLBACK),
    "logits_processors": ("None or a list of callables (tokens, logits) -> logits, as "
                          "mlx_lm.sample_utils.make_logits_processors returns",
                          lambda v: v is None or (isinstance(v, (list, tuple))
                                                  and all(callable(p) for p in v))),
}


def check_arguments(**named) -> None:
    """Raise ValueError for the first argument that is not what the API expects."""
    for name, value in named.items():
        if name == "prompt":
            check_prompt(value)
        elif name in CHECKS:
            expected, test = CHECKS[name]
            if not test(value):
                raise ValueError(f"{name} must be {expected}, got {_show(value)}.")


def check_instance(name: str, value, kind: type, expected: str = "") -> None:
    """Raise ValueError unless `value` is a `kind`: for arguments whose type lives in a module
    above this one (the module that defines the type checks it where the argument enters)."""
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {expected or 'a ' + kind.__name__}, got {_show(value)}.")


def check_prompt(prompt) -> None:
    """A prompt is text, a list or tuple of int token ids, or a 1-D integer array.

    Emptiness and the vocabulary range are checked where the tokens are made.
    """
    if isinstance(prompt, str):
        return
    if isinstance(prompt, (list, tuple)):
        bad = next((t for t in prompt if not _is_int(t)), None)
        if bad is not None:
            raise ValueError(f"prompt must be {PROMPT_EXPECTED}, got a {type(prompt).__name__} "
                             f"holding {_show(bad)}.")
        return
    shape, dtype = getattr(prompt, "shape", None), getattr(prompt, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"prompt must be {PROMPT_EXPECTED}, got {_show(prompt)}.")
    if len(shape) != 1:
        raise ValueError(f"prompt must be {PROMPT_EXPECTED}, got an array of shape "
                         f"{tuple(shape)}; pass one sequence.")
    if not _is_integer_dtype(dtype):
        raise ValueError(f"prompt must be {PROMPT_EXPECTED}, got an array of {dtype}.")


def _is_integer_dtype(dtype) -> bool:
    import mlx.core as mx  # only an array prompt gets here, and MLX made it
    import numpy as np

    if isinstance(dtype, mx.Dtype):
        return mx.issubdtype(dtype, mx.integer)
    try:
        return np.issubdtype(dtype, np.integer)
    except TypeError:  # another library's dtype
        return False


def _show(value) -> str:
    """A short description of a bad value for the message."""
    if isinstance(value, (bool, int, float, str, type(None))):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"


EMBEDDINGS_BESIDE_A_HEAD = ("input_embeddings work with a draft model or prompt lookup, not with "
                            "an MTP head, a DFlash drafter or an EAGLE-3 head (they read the "
                            "target's own prompt pass).")


def check_input_embeddings(model, embeddings, prompt_tokens: int = 0,
                           ids_optional: bool = True) -> None:
    """ValueError, in one sentence, unless `embeddings` can stand for a prompt fed to `model`
    (a call's `input_embeddings`, a batch row's): a model that takes them, an mx.array of shape
    (positions, the model's hidden size), as many positions as `prompt_tokens` ids (0: no ids,
    where `ids_optional`)."""
    import mlx.core as mx
    from mlx_lm.utils import does_model_support_input_embeddings

    if not does_model_support_input_embeddings(model):
        raise ValueError("This model does not take input_embeddings.")
    if not isinstance(embeddings, mx.array) or embeddings.ndim != 2 or embeddings.shape[0] == 0:
        raise ValueError("input_embeddings must be an mx.array of shape (prompt tokens, hidden "
                         "size).")
    hidden = getattr(getattr(model, "args", None), "hidden_size", None)
    if isinstance(hidden, int) and embeddings.shape[1] != hidden:
        raise ValueError(f"input_embeddings are {embeddings.shape[1]} wide: the model's hidden "
                         f"size is {hidden}.")
    if prompt_tokens and prompt_tokens != embeddings.shape[0]:
        raise ValueError(f"input_embeddings hold {embeddings.shape[0]} positions and the prompt "
                         f"{prompt_tokens} token ids; give as many ids"
                         + (", or none." if ids_optional else "."))
