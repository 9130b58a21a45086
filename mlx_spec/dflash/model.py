"""The DFlash drafter's layers: a few Qwen3-style layers that fill a block of mask positions.

What the published checkpoints compute (z-lab's `DFlashDraftModel`, read from
its public descriptions; this is our own code):

- context: the target's hidden states at every position it has processed,
  tapped at the outputs of the layers `target_layer_ids` and concatenated,
  become `hidden_norm(fc(taps))`, one row per position. In every layer they
  enter ONLY as extra keys and values (k_proj, k_norm, v_proj, RoPE at their
  absolute positions), never through input_layernorm; only these are cached.
- block: [the last token] + [mask] * (B - 1), embedded with the target's own
  embedding, at positions c .. c + B - 1 after the c context positions. Full
  layers are bidirectional inside the block and sliding layers causal, unless
  the config's `is_causal` says otherwise for all (z-lab's `dflash/model.py`);
  a sliding layer's query at position p sees keys at positions j with
  p - j < window (and, bidirectional, j - p < window too).
- output: the drafter's own `norm`, then the TARGET's output head; block rows
  1 .. B - 1 are the B - 1 drafts.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from .config import DFlashConfig


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                             config.num_key_value_heads, config.head_dim)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rope = initialize_rope(head_dim, config.rope_theta, False, config.rope_scaling)
        self.scale = head_dim ** -0.5

    def keys_values(self, x: mx.array, offset: int):
        """(keys, values) of rows x (1, T, H) at positions offset..: (1, kv_heads, T, head_dim)."""
        B, T, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, T, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset=offset), values

    def __call__(self, x: mx.array, context_keys: mx.array, context_values: mx.array,
                 offset: int, mask: Optional[mx.array]) -> mx.array:
        """The block x (1, B, H) at positions offset..; the context's cached keys and values."""
        B, T, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, T, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=offset)
        block_keys, block_values = self.keys_values(x, offset)
        keys = mx.concatenate([context_keys, block_keys], axis=2)  # (1, kv_heads, c + B, hd)
        values = mx.concatenate([context_values, block_values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                                   mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, context_keys, context_values, offset, mask):
        h = x + self.self_attn(self.input_layernorm(x), context_keys, context_values, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's own weights (no embedding, no output head: it borrows the target's)."""

    layer_class = DFlashLayer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.dflash_config = config
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def context(self, taps: mx.array) -> mx.array:
        """Tapped target rows (T, taps * H) -> the context rows every layer reads (1, T, H)."""
        return self.hidden_norm(self.fc(taps[None]))

    def block(self, x: mx.array, keys: List[mx.array], values: List[mx.array], offset: int,
              masks: List[Optional[mx.array]]) -> mx.array:
        """The embedded block x (1, B, H) at positions offset..; per layer its context's
        keys/values and mask. Returns the normed block rows (1, B, H) for the target's head."""
        for layer, k, v, mask in zip(self.layers, keys, values, masks):
            x = layer(x, k, v, offset, mask)
        return self.norm(x)
