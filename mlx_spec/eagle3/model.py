"""The EAGLE-3 head: fc over three tapped target layers, one decoder layer, norm, lm_head.

For the pair (h_i, x_{i+1}) (the target's taps at position i, the token after it):

    f   = fc(input_norm?([low_i, mid_i, high_i]))                    (T, H)   fuse
    a   = [input_layernorm(e(x_{i+1})), hidden_norm(f)]              (T, 2H)  q/k/v read 2H
    r   = f (or hidden_norm(f) with norm_before_residual)
    u   = r + o_proj(attention(a))                                   own KV cache, RoPE
    g   = u + mlp(post_attention_layernorm(u))                       pre-norm output
    q   = softmax(lm_head(norm(g)))                                  over the draft vocabulary

`g` is what the next chained step reads in place of f (no fc: it is already H wide), with the
embedding of the token just drafted: EAGLE's cnets.py `topK_genrate`, vLLM's and SGLang's
llama_eagle3.py. A draft id d is the target id d + d2t[d]. The embedding is the head's own
`embed_tokens` when the checkpoint has one, else the target's (see drafters/eagle3.py).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .config import Eagle3Config


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        width, bias = config.head_dim, config.attention_bias
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = width ** -0.5
        self.q_proj = nn.Linear(2 * config.hidden_size, self.heads * width, bias=bias)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.kv_heads * width, bias=bias)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.kv_heads * width, bias=bias)
        self.o_proj = nn.Linear(self.heads * width, config.hidden_size, bias=bias)
        self.rope = initialize_rope(width, config.rope_theta, False, config.rope_scaling,
                                    config.max_position_embeddings)

    def __call__(self, x: mx.array, mask, cache: KVCache) -> mx.array:
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, m, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, m, bias=bias)
        self.up_proj = nn.Linear(h, m, bias=bias)
        self.down_proj = nn.Linear(m, h, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """EAGLE's `midlayer` (speculators: `layers.0`)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = Attention(config)
        self.mlp = MLP(config)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)  # (1, T, 2H)
        u = residual + self.self_attn(x, create_attention_mask(x, cache), cache)
        return u + self.mlp(self.post_attention_layernorm(u))  # (1, T, H) pre-norm


class Eagle3Head(nn.Module):
    """A loaded EAGLE-3 head (`load_eagle3`); `eagle3_config` says how it reads the target."""

    def __init__(self, config: Eagle3Config, fc_bias: bool = False, own_embedding: bool = False):
        super().__init__()
        self.eagle3_config = config
        taps = 3 * config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = nn.RMSNorm(taps, eps=config.rms_norm_eps)
        self.fc = nn.Linear(taps, config.hidden_size, bias=fc_bias)
        self.midlayer = MidLayer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # d2t: draft id d is target id d + d2t[d] (loaded; not a parameter to train)
        self._d2t = mx.zeros((config.draft_vocab_size,), mx.int64)
        self._index: Optional[mx.array] = None

    @property
    def d2t(self) -> mx.array:
        return self._d2t

    def set_d2t(self, d2t: mx.array) -> None:
        self._d2t = d2t.astype(mx.int64)
        # index[t]: the draft id of target id t, or draft_vocab_size (a -inf slot) for none
        draft = self.eagle3_config.draft_vocab_size
        index = [draft] * self.eagle3_config.vocab_size
        for d, t in enumerate(self.target_ids().tolist()):
            index[t] = d
        self._index = mx.array(index, mx.uint32)

    def target_ids(self) -> mx.array:
        """(draft_vocab_size,) the target id of each draft id."""
        return mx.arange(self.eagle3_config.draft_vocab_size, dtype=mx.int64) + self._d2t

    def fuse(self, taps: mx.array) -> mx.array:
        """(..., 3 * target H) tapped target rows, in the head's dtype -> (..., H)."""
        taps = taps.astype(self.fc.weight.dtype)  # (a half-precision or quantized target)
        if "input_norm" in self:
            taps = self.input_norm(taps)
        return self.fc(taps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """(B, T, H) embeddings and (B, T, H) hidden states (fused taps, or its own outputs),
        in the head's dtype -> (B, T, H) pre-norm outputs; the cache gains T entries a row."""
        dtype = self.fc.weight.dtype  # (a quantized or half-precision target embedding)
        return self.midlayer(embeds.astype(dtype), hidden.astype(dtype), cache)

    def draft_logits(self, g: mx.array) -> mx.array:
        """(..., draft_vocab_size) logits over the draft vocabulary."""
        return self.lm_head(self.norm(g))

    def logits(self, g: mx.array) -> mx.array:
        """(..., V) logits over the target's vocabulary: -inf outside the draft vocabulary."""
        draft = self.draft_logits(g)
        pad = mx.full(draft.shape[:-1] + (1,), -mx.inf, draft.dtype)
        return mx.take(mx.concatenate([draft, pad], axis=-1), self._index, axis=-1)

    def make_cache(self) -> List[KVCache]:
        return [KVCache()]
