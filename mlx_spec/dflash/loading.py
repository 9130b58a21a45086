"""Loading a published DFlash drafter, and checking that it fits a target.

A drafter is read from a local directory or a Hugging Face repo id already in
the local cache (the hub is asked only when HF_HUB_OFFLINE allows it), or
`"dflash"`: the drafter shipped for the shipped default target:
config.json (`DFlashDraftModel` or `DFlash2DraftModel`) and *.safetensors
with the published names (`fc`, `hidden_norm`, `norm`, `layers.N.*`, and for
DFlash2 `layers.N.{attention,mlp}_conv.*` and `candidate_selector.*`; a
`model.` prefix is accepted).
Every problem is one sentence: an unknown layout, missing or unexpected
weights, weights of the wrong shape, or a drafter whose hidden size, tap
layers, mask token or (DFlash2) candidate selector's vocabulary do not fit the
target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..default_models import DEFAULT_DFLASH_PATH
from ..drafter_files import directory_of, load_checked, local_directory, located, \
    read_config, read_weights
from ..loading import vocab_size
from ..mtp.heads import text_model
from .config import DFlashConfig, is_dflash_config, parse_config
from .dflash2 import DFlash2Model
from .model import DFlashModel
from .taps import decoder_layers, embedding

SHIPPED = "dflash"  # the name of the drafter shipped for the shipped target


def dflash_directory(path) -> Optional[Path]:
    """The local directory of a DFlash drafter at `path` (a directory or a cached repo id),
    or None when `path` is not one (any other model, or nothing there)."""
    return directory_of(_local(str(path)), is_dflash_config)


def load_dflash(path) -> DFlashModel:
    """The drafter at `path`; ValueError with one sentence when it cannot be used."""
    directory, where = located(path, "DFlash drafter", _local)
    config = parse_config(read_config(directory, where), where)
    model = DFlashModel(config) if config.dflash2 is None else DFlash2Model(config)
    load_checked(model, read_weights(directory, where), where, config.architecture)
    mx.eval(model.parameters())
    if hasattr(model, "loaded"):
        model.loaded()
    return model


def check_fits(drafter: DFlashModel, target_model) -> None:
    """ValueError unless the drafter can read this target's hidden states and vocabulary."""
    config: DFlashConfig = drafter.dflash_config
    text = text_model(target_model)
    target_hidden = getattr(getattr(text, "args", None), "hidden_size", None) or \
        embedding(target_model).weight.shape[-1]
    if config.hidden_size != target_hidden:
        raise ValueError(f"The DFlash drafter's hidden size is {config.hidden_size} and the "
                         f"target's is {target_hidden}; use the drafter published for this target.")
    num_layers = len(decoder_layers(target_model))
    outside = [i for i in config.target_layer_ids if i >= num_layers]
    if outside:
        raise ValueError(f"The DFlash drafter taps target layer {outside[0]}, and the target has "
                         f"{num_layers} layers (0..{num_layers - 1}); use the drafter published "
                         "for this target.")
    vocab = vocab_size(target_model)
    if not 0 <= config.mask_token_id < vocab:
        raise ValueError(f"The DFlash drafter's mask token {config.mask_token_id} is outside the "
                         f"target's vocabulary (0..{vocab - 1}); use the drafter published for "
                         "this target.")
    if config.dflash2 is not None and config.dflash2.vocab_size != vocab:
        raise ValueError(f"The DFlash2 drafter's candidate selector covers "
                         f"{config.dflash2.vocab_size} tokens and the target's vocabulary has "
                         f"{vocab}; use the drafter published for this target.")


def is_dflash_model(value) -> bool:
    return isinstance(value, DFlashModel)


def _local(path: str) -> Optional[Path]:
    if path == SHIPPED and not Path(path).exists():
        return DEFAULT_DFLASH_PATH
    return local_directory(path)
