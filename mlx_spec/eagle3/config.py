"""An EAGLE-3 head's config.json, in any of the three published layouts, as one `Eagle3Config`.

The layouts (each read as its own code reads it; docs/drafting.md, "EAGLE-3 heads"):

- original (SafeAILab/EAGLE, `LlamaForCausalLMEagle3`): a Llama config at the top level with
  `draft_vocab_size`; no tap layers are written, the target's code taps its defaults.
- speculators (vllm-project/speculators, `Eagle3Speculator`): `speculators_config`,
  `speculators_model_type: "eagle3"`, the layer's shape under `transformer_layer_config`,
  `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, `norm_before_fc`.
- SpecForge (sgl-project/SpecForge, what SGLang reads): the original layout plus
  `eagle_config: {"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state": ...}`.

Tap layers come in two conventions. EAGLE's own target code, vLLM and the speculators config
count the *input* of decoder layer i (`hidden_states[i]` of Hugging Face's output_hidden_states,
0 being the embeddings), i.e. the output of layer i - 1; the default is (2, L // 2, L - 3).
SpecForge's `eagle_config` ids count the *output* of decoder layer i (SGLang adds one before
capturing). `Eagle3Config.tap_layers(L)` returns the decoder-layer outputs to tap
(mlx_spec.dflash.taps' convention) either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

ORIGINAL, SPECULATORS, SPECFORGE = "eagle3", "speculators", "specforge"


@dataclass(frozen=True)
class Eagle3Config:
    layout: str  # ORIGINAL, SPECULATORS or SPECFORGE
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary: the embedding's rows, t2d's length
    draft_vocab_size: int  # the head's lm_head rows
    target_hidden_size: int  # the width of each tapped hidden state (fc reads 3 of them)
    aux_layer_ids: Optional[Tuple[int, ...]]  # as written; None: the default
    ids_are_outputs: bool  # True: output of decoder layer i (SpecForge); False: its input
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def tap_layers(self, num_layers: int) -> Tuple[int, ...]:
        """The target's decoder layers whose outputs the head reads, in order."""
        if self.aux_layer_ids is None:  # EAGLE's modeling_llama_kv.py, vLLM, SGLang
            return tuple(i - 1 for i in (2, num_layers // 2, num_layers - 3))
        return tuple(i if self.ids_are_outputs else i - 1 for i in self.aux_layer_ids)

    def describe_taps(self, num_layers: int) -> str:
        return ", ".join(str(i) for i in self.tap_layers(num_layers))


def _architectures(config: dict) -> list:
    value = config.get("architectures") or []
    return [str(a) for a in value] if isinstance(value, list) else [str(value)]


def is_eagle_config(config: dict) -> bool:
    """Whether a config.json describes an EAGLE head of any generation (so that a draft
    directory holding one is read as a head, and an unusable one refused in one sentence)."""
    if not isinstance(config, dict):
        return False
    return any("eagle" in a.lower() for a in _architectures(config)) or \
        "speculators_config" in config or "eagle_config" in config or \
        str(config.get("speculators_model_type", "")).lower().startswith("eagle") or \
        ("draft_vocab_size" in config and "dflash_config" not in config)


def layout_of(config: dict, where: str) -> str:
    """ORIGINAL, SPECULATORS or SPECFORGE; ValueError naming what the config is otherwise."""
    kind = str(config.get("speculators_model_type", "")).lower()
    algorithm = str((config.get("speculators_config") or {}).get("algorithm", "")).lower() \
        if isinstance(config.get("speculators_config"), dict) else ""
    if kind or algorithm or "speculators_config" in config:
        if "eagle3" in (kind, algorithm):
            return SPECULATORS
        raise ValueError(f"{where} is a speculators '{kind or algorithm or 'unknown'}' model; "
                         "mlx-spec reads EAGLE-3 heads (speculators_model_type eagle3).")
    if "eagle_config" in config:
        return SPECFORGE
    architectures = _architectures(config)
    if any("eagle3" in a.lower() for a in architectures) or "draft_vocab_size" in config:
        return ORIGINAL
    raise ValueError(f"{where} is an EAGLE head of an unknown layout (architectures "
                     f"{architectures or 'missing'}); mlx-spec reads EAGLE-3 heads in the original "
                     "(LlamaForCausalLMEagle3 with draft_vocab_size), speculators or SpecForge "
                     "layouts.")


def _ids(value, where: str) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 3 or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be three layer "
                         f"indices, got {value!r}.")
    return tuple(value)


def parse_config(config: dict, where: str) -> Eagle3Config:
    """The head's config; ValueError with one sentence when it is not one mlx-spec can run."""
    layout = layout_of(config, where)
    layer = config
    ids, outputs = config.get("eagle_aux_hidden_state_layer_ids"), False
    if layout == SPECULATORS:
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{where} has no transformer_layer_config; it is not a complete "
                             "speculators EAGLE-3 config.")
    elif layout == SPECFORGE:
        eagle = config.get("eagle_config")
        if not isinstance(eagle, dict):
            raise ValueError(f"{where}: eagle_config must be an object, got {eagle!r}.")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError(f"{where} reads the target's last hidden state only "
                             "(use_aux_hidden_state false); mlx-spec reads EAGLE-3 heads that "
                             "fuse three tapped layers.")
        if eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
            ids, outputs = eagle["eagle_aux_hidden_state_layer_ids"], True
        config = {**config, "norm_before_fc": eagle.get("norm_before_fc",
                                                        config.get("norm_before_fc", False))}
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{where} describes a head of {layers} decoder layers; mlx-spec reads "
                         "one-layer EAGLE-3 heads (the published form).")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r}; mlx-spec's EAGLE-3 layer is Llama's "
                         "(silu).")
    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
        config_values = dict(
            intermediate_size=int(layer["intermediate_size"]),
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where} lacks a usable {exc.args[0] if exc.args else 'field'} for the "
                         "head's layer.") from None
    draft_vocab = config.get("draft_vocab_size", layer.get("draft_vocab_size")) or vocab
    target_hidden = config.get("target_hidden_size") or hidden
    return Eagle3Config(
        layout=layout, hidden_size=hidden, num_attention_heads=heads,
        rope_scaling=layer.get("rope_scaling"), vocab_size=vocab,
        draft_vocab_size=int(draft_vocab), target_hidden_size=int(target_hidden),
        aux_layer_ids=_ids(ids, where), ids_are_outputs=outputs,
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)), **config_values)
