"""MTP layers of the families that ship them, bound to their target's embedding and output head.

An MTP layer predicts the token two places after a target position i from
the target's hidden state there and the embedding of the token after it:

    qwen (qwen3_next, qwen3_5, qwen3_5_moe):
        g = norm(layer(fc([pre_fc_norm_embedding(e(x_{i+1})), pre_fc_norm_hidden(h_i)])))
    deepseek (deepseek_v3, glm4_moe):
        g = shared_head.norm(layer(eh_proj([enorm(e(x_{i+1})), hnorm(h_i)])))

then logits = the target's own head(g). The embedding comes first in the
concatenation in both (vLLM's qwen3_next_mtp.py, qwen3_5_mtp.py and
deepseek_mtp.py). `layer` is a full-attention decoder layer of the target's
own class with its own KV cache. h_i is the target's hidden state after its
final norm, as mlx-lm's `model.model(...)` returns it (vLLM and mlx-vlm feed
the same). A draft of depth d feeds the layer its own output g (after the
MTP norm) in place of h, with the embedding of the token it just drafted.
DeepSeek's embedding is zeroed at position 0, as vLLM does (here: where the
MTP cache is empty, which with a reused prompt cache is the call's first token).

A target of another family can draft with an MTP head trained for it in the
DeepSeek layout (the shipped default target has one): `layer`, from the head's
`mtp_config.json`, then gives the shape of its decoder layer (of the target's
own class), which the target's config cannot say.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, gather_last_axis
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..precision import compute_dtype, head_for, prepare_drafter

QWEN, DEEPSEEK = "qwen", "deepseek"
STYLES = {"qwen3_next": QWEN, "qwen3_5": QWEN, "qwen3_5_moe": QWEN,
          "deepseek_v3": DEEPSEEK, "glm4_moe": DEEPSEEK}


def text_model(model):
    """The module holding `.model` (the trunk), `.args` and the output head (qwen3_5 wraps one)."""
    return getattr(model, "language_model", model)


def model_type(model) -> str:
    args = getattr(text_model(model), "args", None)
    return str(getattr(model, "model_type", None) or getattr(args, "model_type", "unknown"))


def mtp_style(model, layer: Optional[dict] = None) -> str:
    """"qwen" or "deepseek"; ValueError for a family without MTP support here.

    `layer`: the config of an MTP head trained for this target (DeepSeek layout).
    """
    name = model_type(model)
    if layer is None and name not in STYLES:
        raise ValueError(
            f"MTP drafting supports qwen3_next, qwen3_5, qwen3_5_moe, deepseek_v3 and glm4_moe "
            f"targets, and this target is a {name}; draft with a draft model or prompt lookup, "
            "or pass mtp_weights= a directory holding an MTP head trained for it (mtp_config.json).")
    if layer is not None and layer.get("model_type") != name:
        raise ValueError(
            f"The MTP head given was trained for a {layer.get('model_type')} target and this "
            f"target is a {name}; give the MTP weights of this very model.")
    return DEEPSEEK if layer is not None else STYLES[name]


def split_target(model) -> Tuple[Callable, Callable]:
    """(trunk, head): head(trunk(x, cache=c)) is exactly what `model(x, cache=c)` computes.

    The trunk (`model`, or a Mamba hybrid's `backbone`) returns the hidden states after
    the final norm (B, T, H); the head is `lm_head`, or the embedding as a linear layer
    when tied. On a sharded target the hidden states are whole on every rank (tensor parallel
    sums each layer's output; a pipeline gathers the last stage's), and a
    head that tensor parallelism split by vocabulary (qwen3_5's) is gathered
    as the model's own forward gathers it, so the logits are whole too.

    TypeError where the model's logits are something else than that head's output (Granite's
    `logits_scaling`, Gemma 2's soft cap, Cohere's `logit_scale`...): checked once per model on
    one token (`_reproduces`), so no caller ever reads unscaled logits as the model's.
    """
    text = text_model(model)
    trunk = text.model if "model" in text else text.backbone  # (nemotron_h: `backbone`)
    config = getattr(text, "args", None) or getattr(text, "config", None)  # (plamo2: config)
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head" not in text
    head = (trunk.embed_tokens if "embed_tokens" in trunk else trunk.embeddings).as_linear \
        if tied else text.lm_head
    if isinstance(head, (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)):
        head = _gathered(head)
    if not _reproduces(text, trunk, head):
        raise TypeError(f"{model_type(model)}'s logits are not its output layer over its "
                        "trunk's hidden states.")
    return trunk, head


_REPRODUCES: Dict[int, Tuple[weakref.ref, bool]] = {}  # id(model) -> (the model, the answer)


def _reproduces(model, trunk, head) -> bool:
    """Whether head(trunk(x)) gives model(x) on one token (fresh caches): once per model."""
    known = _REPRODUCES.get(id(model))
    if known is not None and known[0]() is model:
        return known[1]
    x = mx.array([[1]], mx.uint32)
    try:
        whole = model(x, cache=make_prompt_cache(model))
        split = head(trunk(x, cache=make_prompt_cache(model)))
        answer = whole.shape == split.shape and mx.allclose(
            whole.astype(mx.float32), split.astype(mx.float32), rtol=1e-3, atol=1e-3).item()
    except Exception:  # (a trunk that cannot run alone: no split)
        answer = False
    _REPRODUCES[id(model)] = (weakref.ref(model), answer)
    return answer


def _gathered(lm_head) -> Callable:
    """A vocabulary-sharded head whose slices are gathered into the whole logits on every rank."""
    def head(x):
        return gather_last_axis(lm_head(x), lm_head.group)
    return head


class QwenBlock(nn.Module):
    """mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm."""

    def __init__(self, layer: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embeds, hidden, cache):
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))  # (1, T, H)
        x = self.layers[0](x, mask=create_attention_mask(x, cache), cache=cache)
        return self.norm(x)


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


class DeepSeekBlock(nn.Module):
    """model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm} and the decoder layer's own names."""

    def __init__(self, layer: nn.Module, hidden_size: int, eps: float, mask_array: bool):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = SharedHead(hidden_size, eps)
        self.block = layer
        self.mask_array = mask_array  # multi-head latent attention takes only an array mask

    def __call__(self, embeds, hidden, cache):
        # Position 0 has no embedding input (vLLM's deepseek_mtp.py). A batch's cache (offsets
        # per row) never starts there: each row's first pairs are fed on a one-row cache.
        if isinstance(cache.offset, int) and cache.offset == 0:
            embeds = embeds * (mx.arange(embeds.shape[1]) > 0)[None, :, None]
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=self.mask_array)
        return self.shared_head.norm(self.block(x, mask, cache))


def make_block(model, layer: Optional[dict] = None) -> Tuple[nn.Module, str]:
    """A fresh (random) MTP block for `model`'s family, with the layer naming of its checkpoints.

    `layer`: a trained head's config; its decoder layer is the trunk's class with
    the shape the config gives (e.g. a narrower MLP).
    """
    style = mtp_style(model, layer)
    text = text_model(model)
    args = text.args
    # A pipeline stage holds None in place of the other stages' layers.
    layers = [(i, each) for i, each in enumerate(text.model.layers) if each is not None]
    layer_class = type(layers[0][1])
    hidden_size, eps = args.hidden_size, args.rms_norm_eps
    if layer is not None:
        shape = {f.name: layer[f.name] for f in fields(args)
                 if f.name in layer and f.name != "model_type"}
        return DeepSeekBlock(layer_class(replace(args, **shape)), hidden_size, eps, False), style
    if style == QWEN:  # a full-attention layer of the trunk's own class (and MLP kind)
        index = next((i for i, each in layers if not each.is_linear),
                     args.full_attention_interval - 1)  # a stage may hold linear layers only
        return QwenBlock(layer_class(args, index), hidden_size, eps), style
    layer = layer_class(args, args.num_hidden_layers)  # its real index: MoE as the checkpoint
    return DeepSeekBlock(layer, hidden_size, eps, model_type(model) == "deepseek_v3"), style


@dataclass
class MTPHead:
    """An MTP block with the target's embedding and output head; `source` says where its weights came from."""

    block: nn.Module
    embed: Callable
    head: Callable
    source: str = ""

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """Feed pairs (h_i, x_{i+1}): tokens (T,), hidden (T, H) -> the block's output (T, H)."""
        return self.block(self.embed(tokens[None]), hidden[None], cache)[0]

    def logits(self, g: mx.array) -> mx.array:
        return self.head(g)

    def make_cache(self) -> List[KVCache]:
        return [KVCache()]

    def drafting(self) -> "MTPHead":
        """This head as drafting runs it: its block converted in place to float32 on the CPU
        backend, the target's output head fed to match (mlx_spec.precision)."""
        prepare_drafter(self.block)
        return replace(self, head=head_for(self.head, compute_dtype(self.block)))


def bind(model, block: nn.Module, source: str = "") -> MTPHead:
    """`block` (weights loaded) drafting with `model`'s embedding and output head."""
    block.eval()
    _, head = split_target(model)
    return MTPHead(block, text_model(model).model.embed_tokens, head, source)
