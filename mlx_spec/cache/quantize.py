"""mlx-lm's `kv_bits` while speculating: the target's attention layers quantized at the token
where mlx-lm's generate_step quantizes them, so the text is the one mlx-lm's own decoding
gives with the same arguments.

mlx-lm quantizes a cache's KVCache layers (`to_quantized`, `maybe_quantize_kv_cache`) after
the forward (a prefill chunk or a step) that brings it to `quantized_kv_start` tokens: every
later position attends quantized keys and values, every earlier one full-precision ones. A
verify pass computes several positions over one cache, so no pass may reach past that point:
`room` is how many positions the next pass may compute (the loop ends a round's drafts and a
plain block's steps there), and `settle` quantizes the layers once the cache holds that many
tokens, in the model cache's list and in the caller's prompt cache. Sliding windows and
recurrent state stay as they are (mlx-lm cannot quantize a window either), and so does the draft
model's cache (its precision changes its proposals, never the text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..defaults import DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START
from .rewind import MARK, ModelCache

CHECKED = MARK + "kv_quantization"  # on a model: the (bits, group size) pairs its layers take


@dataclass
class KVQuantizer:
    cache: ModelCache  # the target's
    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE
    start: int = DEFAULT_QUANTIZED_KV_START
    shown: Sequence[list] = ()  # other lists holding the same layers (the caller's prompt cache)
    done: bool = False

    def room(self) -> Optional[int]:
        """How many positions the next pass may compute on full-precision layers (the last
        one at start - 1; one, where the cache holds `start` already but no forward has run
        since: mlx-lm quantizes after a forward); None once they are quantized (no limit:
        a reused cache may come quantized)."""
        if not self.done and not any(type(layer) is KVCache for layer in self.cache.layers):
            self.done = True
        return None if self.done else max(1, self.start - self.cache.length)

    def settle(self) -> None:
        """Quantize the attention layers once the cache holds `start` tokens (once)."""
        if self.done or self.cache.length < self.start:
            return
        replaced = self.cache.quantize(self.group_size, self.bits)
        for layers in self.shown:
            for i, layer in enumerate(layers):
                layers[i] = replaced.get(id(layer), layer)
        self.done = True


def check_kv_quantization(model, bits: int, group_size: int,
                          max_kv_size: Optional[int] = None) -> None:
    """ValueError, in one sentence, unless `model`'s attention layers quantize with these
    arguments: it has full attention layers (mlx-lm cannot quantize a sliding window, which
    every layer is with `max_kv_size`), and the group size divides their keys' and values'
    width (tried once per model on one token through a cache of its own, before any token
    is decoded)."""
    if max_kv_size is not None:
        raise ValueError("kv_bits quantizes full attention layers, and max_kv_size makes every "
                         "layer a sliding window, which mlx-lm cannot quantize: pass one of "
                         "them.")
    checked = getattr(model, CHECKED, set())
    if (bits, group_size) in checked:
        return
    layers = make_prompt_cache(model)
    if not any(type(layer) is KVCache for layer in layers):
        raise ValueError("kv_bits quantizes full attention layers, and this model has none (its "
                         "attention layers are sliding windows, or it has recurrent state "
                         "alone): leave kv_bits out.")
    model(mx.array([[0]]), cache=layers)
    for layer in layers:
        if type(layer) is KVCache:
            try:
                mx.eval(layer.to_quantized(group_size=group_size, bits=bits).state)
            except ValueError:
                widths = sorted({layer.keys.shape[-1], layer.values.shape[-1]})
                fits = [g for g in (32, 64, 128) if all(w % g == 0 for w in widths)]
                raise ValueError(
                    f"This model's keys and values are {' and '.join(map(str, widths))} wide, "
                    f"which kv_group_size {group_size} does not divide: pass "
                    + (f"kv_group_size={fits[-1]}." if fits else "no kv_bits (no group size "
                       "MLX takes, 32, 64 or 128, divides them).")) from None
    object.__setattr__(model, CHECKED, checked | {(bits, group_size)})  # (not a parameter)
