"""A DFlash drafter's config.json, read as published: one sentence for anything it cannot use.

Two generations of z-lab's `DFlashDraftModel` configs are read: `block_size`
at the top level or only in `dflash_config`, RoPE as `rope_theta` (+
`rope_scaling`) or as `rope_parameters`. `dflash_config.mask_token_id` and
`target_layer_ids` are required: a mask id defaulted to 0 keeps greedy parity
and silently ruins acceptance, so a missing one is refused. `target_layer_ids`
index decoder-layer OUTPUTS, 0-based (Hugging Face's `hidden_states[i + 1]`).

`DFlash2DraftModel` is the same drafter plus grouped dynamic causal
convolutions around every attention and MLP sublayer and a candidate
selector (`DFlash2Parts`): `dflash_config.conv_kernel_size`,
`conv_group_size` (dividing hidden_size), `selector_rank`, `selector_top_k`
and the top-level `vocab_size` (the codebooks' rows) are required;
`output_multiplier`, `final_logit_softcapping` and `input_embedding_scale`
are optional (read from `dflash_config`, else the top level).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE2 = "DFlash2DraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DFlash2Parts:
    """What a DFlash2DraftModel adds to the DFlash layout."""

    conv_kernel_size: int  # taps of each causal convolution (offsets 0 .. K - 1)
    conv_group_size: int  # channels sharing one dynamic tap weight
    selector_rank: int  # width of the codebooks and the hidden projection
    selector_top_k: int  # candidates per block position
    vocab_size: int  # rows of the codebooks
    output_multiplier: float = 1.0  # the drafter's logits are multiplied by it,
    final_logit_softcapping: Optional[float] = None  # then soft-capped: cap * tanh(x / cap)
    input_embedding_scale: float = 1.0  # on top of the target's own embedding scale


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
    is_causal: Optional[bool]  # None: sliding layers causal inside the block, full ones not
    rope_theta: float
    rope_scaling: Optional[dict]
    dflash2: Optional[DFlash2Parts] = None  # a DFlash2DraftModel's convolutions and selector

    @property
    def architecture(self) -> str:
        return ARCHITECTURE if self.dflash2 is None else ARCHITECTURE2

    def causal(self, layer: int) -> bool:
        """Whether layer `layer`'s queries see only earlier block positions. z-lab's
        `dflash/model.py` (`Qwen3DFlashAttention`): the config's `is_causal` for every layer when
        it says one, else sliding layers causal and full ones bidirectional."""
        if self.is_causal is None:
            return self.layer_types[layer] == "sliding_attention"
        return bool(self.is_causal)

    @property
    def all_causal(self) -> bool:
        """Every layer causal inside the block: a block cut after row k is exactly its first
        rows."""
        return all(self.causal(i) for i in range(self.num_hidden_layers))

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def is_dflash_config(config: dict) -> bool:
    """Does this config.json describe a DFlash-style block drafter (supported or not)?"""
    names = config.get("architectures") or []
    return bool(names) and names[0] in (ARCHITECTURE, ARCHITECTURE2)


def parse_config(config: dict, where: str = "the drafter") -> DFlashConfig:
    """The config of a published `DFlashDraftModel` or `DFlash2DraftModel`; ValueError naming
    what is wrong."""
    names = config.get("architectures") or []
    name = names[0] if names else None
    if name not in (ARCHITECTURE, ARCHITECTURE2):
        raise ValueError(f"{where} is not a DFlash drafter (architectures {names!r}); expected "
                         f"{ARCHITECTURE} or {ARCHITECTURE2}.")
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
        rope_theta=float(theta), rope_scaling=scaling,
        dflash2=_dflash2_parts(config, hidden, block, where) if name == ARCHITECTURE2 else None)


def _dflash2_parts(config: dict, hidden: int, block: int, where: str) -> DFlash2Parts:
    """The convolution and selector settings of a DFlash2DraftModel config."""
    dflash = config.get("dflash_config") or {}

    def setting(key, default=None):  # dflash_config first, then the top level
        return dflash.get(key, config.get(key, default))

    sizes = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = setting(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where} is a {ARCHITECTURE2} and needs dflash_config.{key}, an "
                             f"int >= 1; got {value!r}.")
        sizes[key] = value
    vocab = _int(config, "vocab_size", where)
    if hidden % sizes["conv_group_size"]:
        raise ValueError(f"{where}'s conv_group_size {sizes['conv_group_size']} does not divide "
                         f"its hidden_size {hidden}.")
    if sizes["conv_kernel_size"] > block:
        raise ValueError(f"{where}'s conv_kernel_size {sizes['conv_kernel_size']} is longer than "
                         f"its block ({block}).")
    if sizes["selector_top_k"] > vocab:
        raise ValueError(f"{where}'s selector_top_k {sizes['selector_top_k']} exceeds its "
                         f"vocab_size {vocab}.")
    cap = setting("final_logit_softcapping") or None  # 0 means none, as in the reference
    factors = {"output_multiplier": setting("output_multiplier", 1.0),
               "input_embedding_scale": setting("input_embedding_scale", 1.0)}
    for key, value in [*factors.items(), ("final_logit_softcapping", cap)]:
        if value is not None and not (isinstance(value, (int, float)) and
                                      math.isfinite(value) and value > 0):
            raise ValueError(f"{where}'s {key} must be a positive number; got {value!r}.")
    return DFlash2Parts(**sizes, vocab_size=vocab,
                        output_multiplier=float(factors["output_multiplier"] or 1.0),
                        final_logit_softcapping=None if cap is None else float(cap),
                        input_embedding_scale=float(factors["input_embedding_scale"] or 1.0))


def _int(config: dict, key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}'s config.json needs {key}, an int >= 1; got {value!r}.")
    return value
