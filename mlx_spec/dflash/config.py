"""A DFlash drafter's config.json, read as published: one sentence for anything it cannot use.

Two generations of z-lab's `DFlashDraftModel` configs are read: `block_size`
at the top level or only in `dflash_config`, RoPE as `rope_theta` (+
`rope_scaling`) or as `rope_parameters`. `dflash_config.mask_token_id` and
`target_layer_ids` are required: a mask id defaulted to 0 keeps greedy parity
and silently ruins acceptance, so a missing one is refused. `target_layer_ids`
index decoder-layer OUTPUTS, 0-based (Hugging Face's `hidden_states[i + 1]`).
`DFlash2DraftModel` (dynamic convolutions and a candidate selector) is not
supported yet and is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

ARCHITECTURE = "DFlashDraftModel"
UNSUPPORTED = {"DFlash2DraftModel": "DFlash2 drafters (dynamic convolutions and a candidate "
                                    "selector) are not supported yet"}
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: Tuple[int, ...]
    layer_types: Tuple[str, ...]
    sliding_window: Optional[int]
    is_causal: Optional[bool]  # None: sliding layers causal, full layers bidirectional
    rope_theta: float
    rope_scaling: Optional[dict]

    def causal(self, layer: int) -> bool:
        """Whether layer `layer`'s queries see only earlier block positions."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def is_dflash_config(config: dict) -> bool:
    """Does this config.json describe a DFlash-style block drafter (supported or not)?"""
    names = config.get("architectures") or []
    return bool(names) and (names[0] == ARCHITECTURE or names[0] in UNSUPPORTED)


def parse_config(config: dict, where: str = "the drafter") -> DFlashConfig:
    """The config of a published `DFlashDraftModel`; ValueError naming what is wrong."""
    names = config.get("architectures") or []
    name = names[0] if names else None
    if name in UNSUPPORTED:
        raise ValueError(f"{where} is a {name}: {UNSUPPORTED[name]}; use a DFlashDraftModel.")
    if name != ARCHITECTURE:
        raise ValueError(f"{where} is not a DFlash drafter (architectures {names!r}); expected "
                         f"{ARCHITECTURE}.")
    dflash = config.get("dflash_config") or {}
    if "mask_token_id" not in dflash:
        raise ValueError(f"{where} has no dflash_config.mask_token_id; the drafter cannot mark the "
                         "positions it is to fill without it.")
    taps = dflash.get("target_layer_ids")
    if not taps or not all(isinstance(t, int) and t >= 0 for t in taps):
        raise ValueError(f"{where} needs dflash_config.target_layer_ids, a list of target layer "
                         f"indices >= 0; got {taps!r}.")
    layers = _int(config, "num_hidden_layers", where)
    heads = _int(config, "num_attention_heads", where)
    hidden = _int(config, "hidden_size", where)
    layer_types = tuple(config.get("layer_types") or ["full_attention"] * layers)
    if len(layer_types) != layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"{where}'s layer_types must list {layers} of {LAYER_TYPES}; "
                         f"got {list(layer_types)!r}.")
    window = config.get("sliding_window")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"{where} has sliding layers but no sliding_window > 0.")
    block = dflash.get("block_size", config.get("block_size", DEFAULT_BLOCK_SIZE))
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{where}'s block_size must be an int >= 2; got {block!r}.")
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where} gives no rope_theta (top level or in rope_parameters).")
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                             else None)
    causal = config.get("is_causal", dflash.get("causal"))
    return DFlashConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=_int(config, "intermediate_size", where),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), block_size=block,
        mask_token_id=int(dflash["mask_token_id"]), target_layer_ids=tuple(taps),
        layer_types=layer_types, sliding_window=window if "sliding_attention" in layer_types
        else None, is_causal=None if causal is None else bool(causal),
        rope_theta=float(theta), rope_scaling=scaling)


def _int(config: dict, key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}'s config.json needs {key}, an int >= 1; got {value!r}.")
    return value
