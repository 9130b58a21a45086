"""Tiny random models of mlx-lm's hybrid and sliding-window classes, for tests.

Each family is built from mlx-lm's own model class with a config small enough
to construct in well under a second, yet mixing the family's layer kinds so
that ``make_prompt_cache(model)`` yields both cache kinds:

- ``qwen3_5``, ``qwen3_next``: Gated DeltaNet layers (ArraysCache) and full
  attention layers (KVCache), ``full_attention_interval=2``.
- ``lfm2``: short-conv layers (ArraysCache) and attention (KVCache).
- ``nemotron_h``: Mamba-2 (ArraysCache), attention (KVCache) and MLP layers
  (no cache, so the cache list is shorter than the layer list).
- ``gemma3_text``: sliding-window layers (RotatingKVCache of size ``window``)
  and one global layer (KVCache).
- ``gpt_oss``: alternating sliding (RotatingKVCache) / full (KVCache) layers
  with a 4-expert, top-2 MoE.

Embeddings are untied wherever the class allows it (lfm2 always ties its
output head to the embedding; see ``make_family``). Weights are random but
deterministic in ``seed``, float32, and weight matrices are scaled up as in
``tests/tiny.py`` so greedy output depends on the context instead of echoing.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from tiny import once

FAMILIES = ["qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "gemma3_text", "gpt_oss"]
# More recurrent hybrids, each a mixer's state beside attention layers (ArraysCache, KVCache):
# Granite 4.0-H (Mamba-2), LFM2-MoE (short convolutions), Jamba (Mamba), PLaMo 2 (Mamba-2),
# OLMo Hybrid (a Gated DeltaNet of its own). Tested by tests/test_more_families.py alone.
# And with no attention layer at all: Mamba, Mamba-2, RWKV-7.
# Falcon-H1 keeps each layer's attention and Mamba-2 state in one CacheList.
# Kimi-Linear (Kimi Delta Attention and MLA), RecurrentGemma (an RG-LRU beside a local attention
# window), Baichuan-M1 (a short convolution over keys and values in each attention layer's
# CacheList, a sliding window on some) and Bailing-MoE-Linear (gated linear attention); Bailing
# hybrid (gated linear attention beside MLA), Bailing-MoE-V3 and Kimi-K3 (Kimi Delta Attention
# beside MLA) and Gear (short convolutions beside full and sliding attention).
MORE_RECURRENT = ["granitemoehybrid", "lfm2_moe", "jamba", "plamo2", "olmo_hybrid", "falcon_h1",
                  "mamba", "mamba2", "rwkv7", "kimi_linear", "recurrent_gemma", "baichuan_m1",
                  "bailing_moe_linear", "bailing_hybrid", "bailing_moe_v3", "gear", "kimi_k3"]

HIDDEN = 32  # divisible by the quantization group size (32)


def _qwen3_5(vocab_size, window):
    from mlx_lm.models import qwen3_5

    # What mlx_lm.load builds for a text-only qwen3_5 checkpoint: the config
    # has no text_config, so ModelArgs.from_dict wraps the whole dict.
    text_config = {
        "model_type": "qwen3_5", "hidden_size": HIDDEN, "intermediate_size": 64,
        "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }
    args = qwen3_5.ModelArgs.from_dict(text_config)
    return qwen3_5.Model(args)


def _qwen3_next(vocab_size, window):
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs.from_dict({
        "model_type": "qwen3_next", "hidden_size": HIDDEN, "intermediate_size": 64,
        "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        # Dense MLP everywhere (num_experts=0); the MoE keys are still required.
        "num_experts": 0, "num_experts_per_tok": 0, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0, "mlp_only_layers": [],
        "moe_intermediate_size": 0,
        "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    })
    return qwen3_next.Model(args)


def _lfm2(vocab_size, window):
    from mlx_lm.models import lfm2

    # lfm2.Model has no lm_head: the output is always embed_tokens.as_linear.
    args = lfm2.ModelArgs.from_dict({
        "model_type": "lfm2", "vocab_size": vocab_size, "hidden_size": HIDDEN,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 3,
        "block_dim": HIDDEN, "block_ff_dim": 64, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
        "rope_theta": 10000.0,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    })
    return lfm2.Model(args)


def _nemotron_h(vocab_size, window):
    from mlx_lm.models import nemotron_h

    args = nemotron_h.ModelArgs.from_dict({
        "model_type": "nemotron_h", "vocab_size": vocab_size, "hidden_size": HIDDEN,
        "intermediate_size": 64, "max_position_embeddings": 4096,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "attention_bias": False,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
        "mlp_bias": False, "layer_norm_epsilon": 1e-5,
        "use_bias": False, "use_conv_bias": True,
        # Mamba, attention, MLP (no cache), Mamba.
        "hybrid_override_pattern": "M*-M",
    })
    return nemotron_h.Model(args)


def _granitemoehybrid(vocab_size, window):
    from mlx_lm.models import granitemoehybrid

    return granitemoehybrid.Model(granitemoehybrid.ModelArgs(
        model_type="granitemoehybrid", vocab_size=vocab_size, hidden_size=HIDDEN,
        intermediate_size=64, num_hidden_layers=4, max_position_embeddings=4096,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
        embedding_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0,
        residual_multiplier=1.0, layer_types=["mamba", "attention", "mamba", "attention"],
        rms_norm_eps=1e-6, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
        shared_intermediate_size=64, tie_word_embeddings=False))


def _lfm2_moe(vocab_size, window):
    from mlx_lm.models import lfm2_moe

    return lfm2_moe.Model(lfm2_moe.ModelArgs.from_dict({
        "model_type": "lfm2_moe", "vocab_size": vocab_size, "hidden_size": HIDDEN,
        "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "use_expert_bias": True, "num_dense_layers": 1, "norm_eps": 1e-5, "conv_bias": False,
        "conv_L_cache": 3, "rope_theta": 10000.0,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"]}))


def _jamba(vocab_size, window):
    from mlx_lm.models import jamba

    return jamba.Model(jamba.ModelArgs.from_dict({
        "model_type": "jamba", "vocab_size": vocab_size, "hidden_size": HIDDEN,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_offset": 1, "attn_layer_period": 2,
        "expert_layer_offset": 1, "expert_layer_period": 2, "num_experts": 1,
        "num_experts_per_tok": 1, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2,
        "mamba_dt_rank": 4, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096}))


def _plamo2(vocab_size, window):
    from mlx_lm.models import plamo2

    return plamo2.Model(plamo2.ModelArgs(
        hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        hidden_size_per_head=8, max_position_embeddings=4096, attention_window_size=4096,
        mamba_d_state=8, mamba_d_conv=4, mamba_num_heads=4, mamba_step=2, mamba_chunk_size=16,
        intermediate_size=64, vocab_size=vocab_size, tie_word_embeddings=False))


def _olmo_hybrid(vocab_size, window):
    from mlx_lm.models import olmo_hybrid

    return olmo_hybrid.Model(olmo_hybrid.ModelArgs(
        model_type="olmo_hybrid", hidden_size=HIDDEN, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        vocab_size=vocab_size, max_position_embeddings=4096, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, tie_word_embeddings=False,
        attention_bias=False, head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2))


def _falcon_h1(vocab_size, window):
    from mlx_lm.models import falcon_h1

    return falcon_h1.Model(falcon_h1.ModelArgs(
        vocab_size=vocab_size, hidden_size=HIDDEN, head_dim=8, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, mamba_d_head=8,
        mamba_d_ssm=32, mamba_d_state=16, mamba_n_heads=4, mamba_chunk_size=16,
        tie_word_embeddings=False))


def _mamba(vocab_size, window):
    from mlx_lm.models import mamba

    return mamba.Model(mamba.ModelArgs(
        model_type="mamba", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64,
        state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=4, tie_word_embeddings=False))


def _mamba2(vocab_size, window):
    from mlx_lm.models import mamba2

    return mamba2.Model(mamba2.ModelArgs(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=vocab_size,
        hidden_size=HIDDEN, intermediate_size=64, state_size=16, num_hidden_layers=2,
        layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=False, time_step_limit=(0.001, 100.0),
        time_step_rank="auto"))


def _rwkv7(vocab_size, window):
    from mlx_lm.models import rwkv7

    from mlx.utils import tree_flatten, tree_unflatten

    model = rwkv7.Model(rwkv7.ModelArgs.from_dict({
        "model_type": "rwkv7", "vocab_size": vocab_size, "hidden_size": HIDDEN,
        "intermediate_size": 64, "norm_eps": 1e-5, "head_dim": 16, "num_hidden_layers": 2,
        "a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8,
        "decay_low_rank_dim": 8, "tie_word_embeddings": False}))
    # Its token-shift mixes, key scales and group norm start at zero (a constant output):
    # uniform in [0, 1) instead
    zeros = [(name, mx.random.uniform(shape=w.shape)) for name, w in
             tree_flatten(model.parameters())
             if name.rsplit(".", 1)[-1] in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k",
                                            "k_a", "r_k") or name.endswith("g_norm.weight")]
    model.update(tree_unflatten(zeros))
    return model


def _kimi_linear(vocab_size, window):
    from mlx_lm.models import kimi_linear

    return kimi_linear.Model(kimi_linear.ModelArgs(
        model_type="kimi_linear", vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, head_dim=8,
        rope_theta=10000.0, rms_norm_eps=1e-6, model_max_length=4096,
        linear_attn_config={"kda_layers": [1, 3], "num_heads": 4, "head_dim": 8,
                            "short_conv_kernel_size": 4},
        num_experts=4, moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, num_experts_per_token=2, first_k_dense_replace=1,
        tie_word_embeddings=False))


def _recurrent_gemma(vocab_size, window):
    from mlx_lm.models import recurrent_gemma

    return recurrent_gemma.Model(recurrent_gemma.ModelArgs(
        model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, hidden_size=HIDDEN,
        intermediate_size=64, logits_soft_cap=30.0, num_attention_heads=4, num_hidden_layers=3,
        num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
        attention_window_size=window, vocab_size=vocab_size,
        block_types=["recurrent", "recurrent", "attention"]))


def _baichuan_m1(vocab_size, window):
    from mlx_lm.models import baichuan_m1

    return baichuan_m1.Model(baichuan_m1.ModelArgs(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
        sliding_window=window, sliding_window_layers=[1], conv_window=2, rms_norm_eps=1e-6,
        tie_word_embeddings=False))


def _bailing_moe_linear(vocab_size, window):
    from mlx_lm.models import bailing_moe_linear

    return bailing_moe_linear.Model(bailing_moe_linear.ModelArgs(
        model_type="bailing_moe_linear", hidden_size=HIDDEN, intermediate_size=64,
        max_position_embeddings=4096, moe_intermediate_size=32, num_experts=4,
        num_shared_experts=1, norm_topk_prob=True, num_attention_heads=4, num_experts_per_tok=2,
        num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=vocab_size, first_k_dense_replace=1, layer_group_size=2, group_norm_size=1,
        topk_group=1, tie_word_embeddings=False))


def _bailing_hybrid(vocab_size, window):
    from mlx_lm.models import bailing_hybrid

    return bailing_hybrid.Model(bailing_hybrid.ModelArgs(
        model_type="bailing_hybrid", hidden_size=HIDDEN, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=2, group_norm_size=1,
        vocab_size=vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, routed_scaling_factor=1.0, head_dim=8, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False))


def _bailing_moe_v3(vocab_size, window):
    from mlx_lm.models import bailing_moe_v3

    return bailing_moe_v3.Model(bailing_moe_v3.ModelArgs(
        model_type="bailing_hybrid", vocab_size=vocab_size, hidden_size=HIDDEN,
        intermediate_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, layer_group_size=2, head_dim=8, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        rope_theta=10000.0, max_position_embeddings=4096))


def _gear(vocab_size, window):
    from mlx_lm.models import gear

    return gear.Model(gear.ModelArgs(
        model_type="gear", vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, layer_types=["conv_mixer", "sliding_attention", "full_attention"],
        sliding_window=window, tie_word_embeddings=False))


def _kimi_k3(vocab_size, window):
    from mlx_lm.models import kimi_k3

    return kimi_k3.Model(kimi_k3.ModelArgs.from_dict({
        "model_type": "kimi_k3", "vocab_size": vocab_size, "hidden_size": HIDDEN,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 64,
        "linear_attn_config": {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 8,
                               "short_conv_kernel_size": 4},
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 8, "num_experts": 4, "num_experts_per_token": 2,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "tie_word_embeddings": False}))


def _gemma3_text(vocab_size, window):
    from mlx_lm.models import gemma3_text

    # Layers 0, 1, 3 slide (RotatingKVCache), layer 2 is global (KVCache).
    args = gemma3_text.ModelArgs.from_dict({
        "model_type": "gemma3_text", "hidden_size": HIDDEN, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "sliding_window": window,
        "sliding_window_pattern": 3, "max_position_embeddings": 4096,
    })
    return gemma3_text.Model(args)  # always has its own lm_head (untied)


def _gpt_oss(vocab_size, window):
    from mlx_lm.models import gpt_oss

    args = gpt_oss.ModelArgs.from_dict({
        "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4,
        "num_experts_per_tok": 2, "vocab_size": vocab_size, "rms_norm_eps": 1e-5,
        "hidden_size": HIDDEN, "intermediate_size": 64, "head_dim": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "sliding_window": window, "rope_theta": 150000,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    })
    return gpt_oss.Model(args)  # always has its own lm_head (untied)


_BUILDERS = {
    "qwen3_5": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "lfm2": _lfm2,
    "nemotron_h": _nemotron_h,
    "gemma3_text": _gemma3_text,
    "gpt_oss": _gpt_oss,
    "granitemoehybrid": _granitemoehybrid,
    "lfm2_moe": _lfm2_moe,
    "jamba": _jamba,
    "plamo2": _plamo2,
    "olmo_hybrid": _olmo_hybrid,
    "falcon_h1": _falcon_h1,
    "mamba": _mamba,
    "mamba2": _mamba2,
    "rwkv7": _rwkv7,
    "kimi_linear": _kimi_linear,
    "recurrent_gemma": _recurrent_gemma,
    "baichuan_m1": _baichuan_m1,
    "bailing_moe_linear": _bailing_moe_linear,
    "bailing_hybrid": _bailing_hybrid,
    "bailing_moe_v3": _bailing_moe_v3,
    "gear": _gear,
    "kimi_k3": _kimi_k3,
}

# Factor on every weight of ndim >= 2: Linear/Embedding matrices as in
# tests/tiny.py, plus the 3-D conv kernels (lfm2, Mamba-2, Gated DeltaNet) and
# gpt_oss's 3-D expert weights. Scaling only the 2-D ones leaves nemotron_h
# and gpt_oss near-repetitive (~10 distinct tokens in 40 for some seeds).
# 1-D norms, biases, A_log, dt_bias and sinks are left as initialized.
WEIGHT_SCALE = 3.0


def _quantizable(group_size):
    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        weight = getattr(module, "weight", None)
        return weight is not None and weight.shape[-1] % group_size == 0
    return predicate


def settled(model, scale: float = WEIGHT_SCALE, noise: float = 0.0):
    """`model` (built under a fixed seed) in float32, every matrix times `scale`, then plus
    `noise` times a normal draw (a related draft), eval'd: the tests' tiny random models of
    families built from their mlx-lm arguments in place (test_unbatchable, test_gemma3n,
    test_wrapped_models)."""
    model.set_dtype(mx.float32)
    model.update(tree_map(lambda w: w * scale if w.ndim >= 2 else w, model.parameters()))
    if noise:
        model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape)
                              if w.ndim >= 2 else w, model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model


def make_family(name: str, seed: int = 0, vocab_size: int = 64, window: int = 8,
                quantize_bits: int | None = None):
    """A random tiny model of mlx-lm's `name` class (untied embeddings), float32, eval'd.

    `window` is the sliding window of gemma3_text and gpt_oss (ignored by the
    others). `quantize_bits` of 4 or 8 quantizes every Linear/Embedding (and
    gpt_oss's SwitchLinear experts) with group size 32 after the scaling.
    lfm2's class has no separate output head, so its embeddings stay tied.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown family {name!r}; expected one of {sorted(_BUILDERS)}")
    if quantize_bits not in (None, 4, 8):
        raise ValueError(f"quantize_bits must be None, 4 or 8, not {quantize_bits}")
    mx.random.seed(seed)
    model = _BUILDERS[name](vocab_size, window)
    model.set_dtype(mx.float32)
    model.update(tree_map(lambda w: w * WEIGHT_SCALE if w.ndim >= 2 else w,
                          model.parameters()))
    if quantize_bits is not None:
        nn.quantize(model, group_size=32, bits=quantize_bits,
                    class_predicate=_quantizable(32))
    model.eval()
    mx.eval(model.parameters())
    return model


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference: mlx-lm's own generate_step with an argmax sampler."""
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                  sampler=lambda lp: mx.argmax(lp, axis=-1)):
        out.append(int(token))
    return out


def shared_family(name: str, seed: int = 0, vocab_size: int = 64,
                  quantize_bits: int | None = None):
    """make_family's model, built once a session for these arguments: for the tests that
    only decode with it (none may change its weights or attributes)."""
    return once(("family", name, seed, vocab_size, quantize_bits), lambda: make_family(
        name, seed=seed, vocab_size=vocab_size, quantize_bits=quantize_bits))


def shared_plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """plain_greedy, computed once a session per model, prompt and length, for a model that
    no test changes."""
    return list(once(("greedy", tuple(prompt), n), lambda: plain_greedy(model, prompt, n),
                     holds=(model,)))


def write_family_dir(path, name: str, seed: int = 0, window: int = 8):
    """A Hugging Face-layout directory of a tiny `name` model that mlx_lm.load reads back."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten
    from tiny import write_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path)
    model = make_family(name, seed=seed, vocab_size=vocab_size, window=window)
    args = model.args
    text = getattr(args, "text_config", None)
    config = dict(text) if isinstance(text, dict) else dict(vars(args))
    config = {k: v for k, v in config.items() if v is not None}
    config.update(model_type=name, eos_token_id=0)
    (path / "config.json").write_text(json.dumps(config, default=str))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def decode_rows(engine, requests) -> tuple[list[list[int]], int, int]:
    """Insert `requests` (RowRequests) into a batch engine and step it until every row ended:
    (each row's tokens, in the requests' order; drafts proposed; drafts kept)."""
    uids = [engine.insert(request) for request in requests]
    got = {uid: [] for uid in uids}
    drafted = accepted = 0
    while engine.busy:
        for out in engine.step():
            got[out.uid] += out.tokens
            drafted += out.num_drafted
            accepted += out.num_accepted
    return [got[uid] for uid in uids], drafted, accepted


def through_the_batch(model) -> str:
    """Two rows (12 and 3 prompt tokens: the shorter left-padded) through the batch's cache,
    four forced tokens a step, against each row alone on mlx-lm's own caches: "crash",
    "wrong" or "exact"."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_spec.batch.kv import BatchCache, row_cache

    prompts = [[5, 17, 3, 40, 9, 5, 17, 3, 11, 2, 8, 30], [1, 2, 3]]
    forced = [[7, 9, 4, 20], [6, 3, 12, 1]]
    alone = []
    for prompt, tokens in zip(prompts, forced):
        own = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=own)
        fed = [prompt[-1]] + tokens[:-1]
        alone.append(mx.concatenate([model(mx.array([[t]]), cache=own)[0] for t in fed]))
    try:
        cache = BatchCache(model)
        for prompt in prompts:
            layers = row_cache(model)
            model(mx.array([prompt[:-1]]), cache=layers)
            cache.join(layers)
        together = []
        for step in range(4):
            x = mx.array([[([p[-1]] + t[:-1])[step]] for p, t in zip(prompts, forced)])
            together.append(cache.forward(x, undoable=False))
        together = mx.concatenate(together, axis=1)
        mx.eval(together)
    except (ValueError, TypeError):  # (MLX's broadcast and conversion errors)
        return "crash"
    same = all(mx.allclose(together[i], alone[i], atol=1e-3).item() for i in range(2))
    return "exact" if same else "wrong"
