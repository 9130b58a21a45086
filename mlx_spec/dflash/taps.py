"""The target's hidden states at chosen layer outputs, captured from a forward it runs anyway.

`tapped(model, ids)` stands a recorder in front of each chosen decoder layer
for the length of one call (the graph is built lazily during the call, so
that is all it takes): the verify pass itself yields the drafter's context,
with no second target pass. The recorder replaces the entry in the list the
model's forward iterates (`model.model.layers`; qwen3_5-style wrappers slice
that list at call time) and forwards every attribute to the layer, so
hybrid, sliding-window and quantized targets run unchanged. It is removed in
`finally`: outside the call the model's parameters are its own again.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Sequence

import mlx.core as mx

from ..mtp.heads import text_model


class _Recorder:
    def __init__(self, layer, outputs: Dict[int, mx.array], index: int):
        self.layer = layer
        self.outputs = outputs
        self.index = index

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.outputs[self.index] = out
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


def trunk(model):
    """The module holding the embedding and the decoder layers (`model`, or `backbone`)."""
    text = text_model(model)
    return text.model if "model" in text else text.backbone


def decoder_layers(model) -> List:
    """The list of decoder layers the model's forward iterates."""
    return trunk(model).layers


def embedding(model):
    """The target's token embedding (the drafter embeds its block with it)."""
    inner = trunk(model)
    return inner.embed_tokens if "embed_tokens" in inner else inner.embeddings


def output_head(model):
    """The target's output layer: lm_head, or the embedding as a linear layer when tied."""
    text = text_model(model)
    tied = getattr(getattr(text, "args", None), "tie_word_embeddings", False)
    return text.lm_head if "lm_head" in text and not tied else embedding(model).as_linear


@contextlib.contextmanager
def tapped(model, ids: Sequence[int]) -> Iterator[Dict[int, mx.array]]:
    """{layer index: that layer's output (B, T, H)} for the forward run inside the block."""
    layers = decoder_layers(model)
    outputs: Dict[int, mx.array] = {}
    originals = {i: layers[i] for i in set(ids)}
    try:
        for i, layer in originals.items():
            layers[i] = _Recorder(layer, outputs, i)
        yield outputs
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def concatenated(outputs: Dict[int, mx.array], ids: Sequence[int]) -> mx.array:
    """The taps in `ids` order, side by side, of a forward over one row: (T, len(ids) * H)."""
    return side_by_side(outputs, ids)[0]


def side_by_side(outputs: Dict[int, mx.array], ids: Sequence[int]) -> mx.array:
    """The taps in `ids` order, side by side: (B, T, len(ids) * H)."""
    return mx.concatenate([outputs[i] for i in ids], axis=-1)


def tap_capture(model, ids: Sequence[int]):
    """(tokens (B, T), cache, forward=None) -> (the model's own output, its taps (B, T,
    len(ids) * H)), one forward: a single sequence's (`ModelCache(capture=...)`, a batch of
    one) and a batch's rows' (mlx_spec.batch). `forward`, when given, runs in its place over
    the same layers (the trunk of a split model: its output is then the trunk's, for the
    prompt look)."""
    def capture(tokens: mx.array, cache, forward=None):
        with tapped(model, ids) as outputs:
            out = (forward or model)(tokens, cache=cache)
        return out, side_by_side(outputs, ids)
    return capture
