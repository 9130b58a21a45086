"""Tiny random DFlash drafters written in the published layout, for tests.

`write_dflash_dir` writes config.json (z-lab's `DFlashDraftModel` keys, either
config generation, or `DFlash2DraftModel`'s from `dflash2_config`) and
model.safetensors with the published weight names, for a target of hidden
size `hidden`; `make_dflash` loads it back through the package's own loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np


def dflash_config(hidden, taps, layers=2, heads=4, kv_heads=2, head_dim=None, block_size=8,
                  mask_token_id=63, layer_types=None, sliding_window=None, is_causal=None,
                  generation="current"):
    head_dim = head_dim or hidden // heads
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "num_target_layers": max(taps) + 1, "vocab_size": 64,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(taps)},
    }
    if generation == "current":  # block size only in dflash_config, rope_parameters
        config["dflash_config"]["block_size"] = block_size
        config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    else:  # the first published configs: block_size and rope_theta at the top level
        config["block_size"] = block_size
        config["rope_theta"] = 10000.0
        config["rope_scaling"] = None
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
        config["sliding_window"] = sliding_window
    if is_causal is not None:
        config["is_causal"] = is_causal
    return config


def dflash2_config(hidden, taps, vocab_size=64, conv_kernel_size=2, conv_group_size=8,
                   selector_rank=8, selector_top_k=4, is_causal=False, extra=None, **kwargs):
    """A `DFlash2DraftModel` config as published: the DFlash keys plus the convolutions' and
    the selector's in dflash_config (`extra`: more dflash_config keys, e.g. output_multiplier);
    top-level is_causal false as in the published fixture."""
    config = dflash_config(hidden, taps, is_causal=is_causal, **kwargs)
    config["architectures"] = ["DFlash2DraftModel"]
    config["vocab_size"] = vocab_size
    config["dflash_config"].update(conv_kernel_size=conv_kernel_size,
                                   conv_group_size=conv_group_size, selector_rank=selector_rank,
                                   selector_top_k=selector_top_k, **(extra or {}))
    return config


def dflash2_weights(config, rng, scale):
    """DFlash2's additions under the published names (the codebooks without `.weight`)."""
    H, dflash = config["hidden_size"], config["dflash_config"]
    K, groups = dflash["conv_kernel_size"], H // dflash["conv_group_size"]
    rank, vocab = dflash["selector_rank"], config["vocab_size"]

    def normal(shape, std):
        return mx.array(rng.normal(0, std, shape).astype(np.float32))

    weights = {"candidate_selector.predecessor_codebook": normal((vocab, rank), 1.0),
               "candidate_selector.successor_codebook": normal((vocab, rank), 1.0),
               "candidate_selector.hidden_projection.weight": normal((rank, H), scale / np.sqrt(H))}
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = normal((2, K, H), 0.5)
            base[:, 0] = base[:, 0] + 1.0  # mostly the position itself, some of the ones before
            weights[f"layers.{i}.{conv}.base_kernel"] = base
            weights[f"layers.{i}.{conv}.kernel_projection.weight"] = normal((2 * K * groups, H),
                                                                           0.5 / np.sqrt(H))
    return weights


def dflash_weights(config, seed=0, scale=3.0, prefix=""):
    """Random weights under the published names (fc, hidden_norm, norm, layers.N.*; for a
    DFlash2 config also the convolutions and the candidate selector)."""
    rng = np.random.default_rng(seed)
    H, heads, kv, hd = (config["hidden_size"], config["num_attention_heads"],
                        config["num_key_value_heads"], config["head_dim"])
    inter, taps = config["intermediate_size"], len(config["dflash_config"]["target_layer_ids"])

    def linear(out, inp):
        return mx.array(rng.normal(0, scale / np.sqrt(inp), (out, inp)).astype(np.float32))

    def norm(n):
        return mx.array((1.0 + 0.1 * rng.normal(size=n)).astype(np.float32))

    weights = {"fc.weight": linear(H, taps * H), "hidden_norm.weight": norm(H),
               "norm.weight": norm(H)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": linear(heads * hd, H),
            p + "self_attn.k_proj.weight": linear(kv * hd, H),
            p + "self_attn.v_proj.weight": linear(kv * hd, H),
            p + "self_attn.o_proj.weight": linear(H, heads * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": linear(inter, H), p + "mlp.up_proj.weight": linear(inter, H),
            p + "mlp.down_proj.weight": linear(H, inter),
            p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
        })
    if config["architectures"] == ["DFlash2DraftModel"]:
        weights.update(dflash2_weights(config, rng, scale))
    return {prefix + name: value for name, value in weights.items()}


def write_dflash_dir(path, config, seed=0, prefix="", drop=(), extra=None):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weights = dflash_weights(config, seed, prefix=prefix)
    for name in drop:
        weights.pop(name)
    weights.update(extra or {})
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def make_dflash(path, hidden, taps, seed=0, **kwargs):
    from mlx_spec.dflash import load_dflash

    return load_dflash(write_dflash_dir(path, dflash_config(hidden, taps, **kwargs), seed))


def make_dflash2(path, hidden, taps, seed=0, **kwargs):
    from mlx_spec.dflash import load_dflash

    return load_dflash(write_dflash_dir(path, dflash2_config(hidden, taps, **kwargs), seed))
