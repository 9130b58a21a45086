"""The target drafts for itself: multi-token-prediction (MTP) layers shipped with the checkpoint.

- `heads.py`: the MTP block of each supported family and the split of the
  target into trunk (hidden states) and head, so the verify pass yields both.
- `weights.py`: where MTP weights come from (mlx-lm drops them) and fitting
  them to the block.
- `load_mtp(model, mtp_weights)`: the block for `model` with its weights,
  bound to the target's embedding and output head (kept on the model, so
  later calls with the same source do not read the weights again).
  A directory with `mtp_config.json` holds a head trained for a target of a
  family without MTP layers (the shipped default target's, in
  `default_models/mtp/`, is found with no argument).

The drafter that uses it is `drafters/mtp.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..default_models import DEFAULT_MTP_PATH, DEFAULT_TARGET_PATH
from .heads import MTPHead, bind, make_block, mtp_style, split_target, text_model
from .weights import convert, load_block, local_name, read_tensors

MODEL_DIR_ATTR = "_mlx_spec_model_dir"  # set by mlx_spec.load: where the model was read from
TRAINED_HEAD_CONFIG = "mtp_config.json"  # beside the weights of a head trained for a target
_LOADED_ATTR = "_mlx_spec_mtp"  # (source, MTPHead) of the last load, on the model object

__all__ = ["MTPHead", "load_mtp", "split_target", "mtp_style", "MODEL_DIR_ATTR"]


def load_mtp(model, mtp_weights: Optional[str] = None) -> MTPHead:
    """`model`'s MTP layer, weights from `mtp_weights` (a directory or repo id) or the model's directory."""
    source = mtp_weights if mtp_weights is not None else _own_source(model)
    layer = trained_head_config(source)
    style = mtp_style(model, layer)  # one sentence for a family without MTP support
    loaded = model.__dict__.get(_LOADED_ATTR)
    if loaded is not None and source is not None and loaded[0] == str(source):
        return loaded[1]
    tensors, raw, where = ({}, False, None) if source is None else \
        read_tensors(str(source), _wanted(style, model, layer is not None))
    if not tensors:
        found_in = f"in {where} " if where else ""
        raise ValueError(
            f"No MTP weights were found {found_in}for this target (mlx-lm drops them when "
            "loading): pass mtp_weights= a local directory or Hugging Face repo of the original "
            "checkpoint, or load the model with mlx_spec.load from a directory whose "
            "safetensors still hold them.")
    block, _ = make_block(model, layer)
    load_block(block, convert(style, tensors, raw, model), where)
    # Evaluated here, as mlx-lm's load does the model's: lazy weights made on this thread
    # cannot be evaluated on another (a server's generation thread).
    mx.eval(block.parameters())
    head = bind(model, block, where)
    object.__setattr__(model, _LOADED_ATTR, (str(source), head))  # not a parameter of the model
    return head


def _own_source(model) -> Optional[str]:
    """Where the model was read from; for the shipped default target, its trained head."""
    directory = getattr(model, MODEL_DIR_ATTR, None)
    if directory is not None and Path(directory).resolve() == DEFAULT_TARGET_PATH:
        return str(DEFAULT_MTP_PATH)
    return directory


def trained_head_config(source: Optional[str]) -> Optional[dict]:
    """The config of a head trained for its target (a local directory with mtp_config.json), else None."""
    path = Path(source).expanduser() / TRAINED_HEAD_CONFIG if source is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"Could not read the MTP head's config {path} ({exc}); check that "
                         "the head's directory is complete.") from exc


def _wanted(style: str, model, trained_head: bool):
    """Which tensors to read; a trained head's directory holds only the head (any layer index)."""
    num_layers = None if trained_head else text_model(model).args.num_hidden_layers
    return lambda name: local_name(style, name, num_layers)
