"""The target drafts for itself: multi-token-prediction (MTP) layers shipped with the checkpoint.

- `heads.py`: the MTP block of each supported family and the split of the
  target into trunk (hidden states) and head, so the verify pass yields both.
- `weights.py`: where MTP weights come from (mlx-lm drops them) and fitting
  them to the block.
- `load_mtp(model, mtp_weights)`: the block for `model` with its weights,
  bound to the target's embedding and output head (kept on the model, so
  later calls with the same source do not read the weights again).

The drafter that uses it is `drafters/mtp.py`.
"""

from __future__ import annotations

from typing import Optional

from .heads import MTPHead, bind, make_block, mtp_style, split_target, text_model
from .weights import convert, load_block, local_name, read_tensors

MODEL_DIR_ATTR = "_mlx_spec_model_dir"  # set by mlx_spec.load: where the model was read from
_LOADED_ATTR = "_mlx_spec_mtp"  # (source, MTPHead) of the last load, on the model object

__all__ = ["MTPHead", "load_mtp", "split_target", "mtp_style", "MODEL_DIR_ATTR"]


def load_mtp(model, mtp_weights: Optional[str] = None) -> MTPHead:
    """`model`'s MTP layer, weights from `mtp_weights` (a directory or repo id) or the model's directory."""
    style = mtp_style(model)  # one sentence for a family without MTP support
    source = mtp_weights if mtp_weights is not None else getattr(model, MODEL_DIR_ATTR, None)
    loaded = model.__dict__.get(_LOADED_ATTR)
    if loaded is not None and source is not None and loaded[0] == str(source):
        return loaded[1]
    tensors, raw, where = ({}, False, None) if source is None else \
        read_tensors(str(source), _wanted(style, model))
    if not tensors:
        found_in = f"in {where} " if where else ""
        raise ValueError(
            f"No MTP weights were found {found_in}for this target (mlx-lm drops them when "
            "loading): pass mtp_weights= a local directory or Hugging Face repo of the original "
            "checkpoint, or load the model with mlx_spec.load from a directory whose "
            "safetensors still hold them.")
    block, _ = make_block(model)
    load_block(block, convert(style, tensors, raw, model), where)
    head = bind(model, block, where)
    object.__setattr__(model, _LOADED_ATTR, (str(source), head))  # not a parameter of the model
    return head


def _wanted(style: str, model):
    num_layers = text_model(model).args.num_hidden_layers
    return lambda name: local_name(style, name, num_layers)
