"""Loading a published EAGLE-3 head, and checking that it fits a target.

A head is read from a local directory or a Hugging Face repo id already in the local cache:
config.json in any of the three layouts (config.py) and *.safetensors with the published
names: `fc.weight` (speculators: also `fc.bias`), `midlayer.*` (speculators: `layers.0.*`),
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional `embed_tokens.weight` and (with
norm_before_fc) `input_norm.weight`; a `model.` prefix is accepted, the speculators'
`verifier_*` copies of the target's norm and head are ignored. Every problem is one sentence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..dflash.taps import decoder_layers, embedding
from ..drafter_files import directory_of, load_checked, local_directory, located, \
    read_config, read_weights
from ..loading import vocab_size
from ..mtp.heads import text_model
from .config import Eagle3Config, is_eagle_config, parse_config
from .model import Eagle3Head

IGNORED = ("verifier_",)


def eagle3_directory(path) -> Optional[Path]:
    """The local directory of an EAGLE head at `path`, or None when `path` is not one."""
    return directory_of(local_directory(str(path)), is_eagle_config)


def _published_name(name: str, where: str) -> Optional[str]:
    """A weight's name in Eagle3Head (None: a weight it leaves out)."""
    if name.startswith(IGNORED):
        return None
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    if name.startswith("layers."):
        raise ValueError(f"{where} holds {name}: a head of more than one decoder layer; "
                         "mlx-spec reads one-layer EAGLE-3 heads.")
    return name


def load_eagle3(path) -> Eagle3Head:
    """The head at `path`; ValueError with one sentence when it cannot be used."""
    directory, where = located(path, "EAGLE-3 head")
    config = parse_config(read_config(directory, where), where)
    weights = read_weights(directory, where, lambda name: _published_name(name, where))
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    head = Eagle3Head(config, fc_bias="fc.bias" in weights,
                      own_embedding="embed_tokens.weight" in weights)
    load_checked(head, weights, where, config.layout)
    head.set_d2t(_checked_maps(config, d2t, t2d, where))
    mx.eval(head.parameters())
    return head


def _checked_maps(config: Eagle3Config, d2t, t2d, where: str) -> mx.array:
    """d2t (draft_vocab_size,) as offsets, checked against t2d; identity when the head drafts
    over the whole vocabulary and writes neither."""
    draft, vocab = config.draft_vocab_size, config.vocab_size
    if d2t is None:
        if draft != vocab:
            raise ValueError(f"{where} drafts over {draft} of {vocab} tokens and has no d2t "
                             "map; it is incomplete.")
        return mx.zeros((draft,), mx.int64)
    if d2t.shape != (draft,) or not mx.issubdtype(d2t.dtype, mx.integer):
        raise ValueError(f"{where}: d2t has shape {tuple(d2t.shape)} ({d2t.dtype}); it must hold "
                         f"one integer offset per draft token ({draft}).")
    targets = (mx.arange(draft, dtype=mx.int64) + d2t.astype(mx.int64)).tolist()
    if min(targets) < 0 or max(targets) >= vocab or len(set(targets)) != draft:
        raise ValueError(f"{where}: d2t maps draft tokens outside the vocabulary of {vocab} or "
                         "two onto one target token; it is not an offset table (target id = "
                         "draft id + d2t[draft id]).")
    if t2d is not None:
        mask = t2d.astype(mx.bool_)
        if t2d.shape != (vocab,) or int(mask.sum().item()) != draft or \
                not mask[mx.array(targets)].all().item():
            raise ValueError(f"{where}: t2d does not mark exactly the {draft} target tokens "
                             "d2t maps to; the two maps disagree.")
    return d2t.astype(mx.int64)


def check_fits(head: Eagle3Head, target_model) -> None:
    """ValueError unless the head can read this target's taps, embedding and vocabulary."""
    config = head.eagle3_config
    text = text_model(target_model)
    target_hidden = getattr(getattr(text, "args", None), "hidden_size", None) or \
        embedding(target_model).weight.shape[-1]
    if config.target_hidden_size != target_hidden:
        raise ValueError(f"The EAGLE-3 head reads hidden states of width "
                         f"{config.target_hidden_size} and the target's are {target_hidden}; "
                         "use the head published for this target.")
    vocab = vocab_size(target_model)
    if config.vocab_size != vocab:
        raise ValueError(f"The EAGLE-3 head's vocabulary maps cover {config.vocab_size} tokens "
                         f"and the target's vocabulary has {vocab}; use the head published for "
                         "this target.")
    if "embed_tokens" not in head and config.hidden_size != target_hidden:
        raise ValueError(f"The EAGLE-3 head has no embedding of its own and its width "
                         f"{config.hidden_size} is not the target's {target_hidden}; it cannot "
                         "borrow the target's embedding.")
    num_layers = len(decoder_layers(target_model))
    taps = config.tap_layers(num_layers)
    outside = [i for i in taps if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"The EAGLE-3 head taps target layer outputs "
                         f"{config.describe_taps(num_layers)} and the target has {num_layers} "
                         f"layers (0..{num_layers - 1}); use the head published for this target.")


def is_eagle3_head(value) -> bool:
    return isinstance(value, Eagle3Head)

