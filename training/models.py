"""The PyTorch models: a minimal Llama (Hugging Face ``LlamaForCausalLM`` parameter
names) for the target and the drafts, and the one-block MTP head trained on the
frozen target, in the DeepSeek-V3 layout ``mlx_spec.mtp`` reads.

The MTP head predicts the token two places after a target position i from the
target's hidden state h_i (after its final norm) and the embedding of x_{i+1}:

    g_i = shared_head.norm(block(eh_proj([enorm(e(x_{i+1})), hnorm(h_i)])))
    logits = target.lm_head(g_i)

with the target's own embedding and output head (not copied into the head).
Drafting at depth 2 feeds g_i in place of h with the embedding of the token just
drafted, one position later, attending to the layer's cache of the true pairs
(``MTPHead.chained``). As in vLLM and ``mlx_spec.mtp.heads``, the embedding of a
sequence's first pair is zeroed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(cfg: LlamaConfig, offset: int, length: int):
    """(cos, sin) of positions offset..offset+length-1, shaped (1, 1, T, head_dim)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(offset, offset + length, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None, None], emb.sin()[None, None]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.hd = h, cfg.head_dim
        self.q_proj = nn.Linear(d, h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, h * self.hd, bias=False)
        self.v_proj = nn.Linear(d, h * self.hd, bias=False)
        self.o_proj = nn.Linear(h * self.hd, d, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.h, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, h, T, hd)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x, cos, sin, cache=None):
        """``cache``: None (training), or a one-item list holding this layer's (k, v) so
        far (None before the first call); it is extended in place."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        first = cache is None or cache[0] is None
        if cache is not None:
            if not first:
                k, v = torch.cat([cache[0][0], k], 2), torch.cat([cache[0][1], v], 2)
            cache[0] = (k, v)
        # later calls feed one token, which sees every cached position
        y = F.scaled_dot_product_attention(q, k, v, is_causal=first)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def chained(self, x, cos, sin, k_prev, v_prev):
        """Query i sees the cached keys 0..i (``k_prev``: (B, h, T, hd)) and its own key only,
        as every chained draft step of a round does, all T in one pass."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        scale = 1.0 / math.sqrt(self.hd)
        prev = (q @ k_prev.transpose(-1, -2)) * scale  # (B, h, T, T)
        prev = prev.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        own = (q * k).sum(-1, keepdim=True) * scale  # (B, h, T, 1)
        w = torch.softmax(torch.cat([prev, own], -1), -1)
        y = w[..., :T] @ v_prev + w[..., T:] * v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def chained(self, x, cos, sin, k_prev, v_prev):
        x = x + self.self_attn.chained(self.input_layernorm(x), cos, sin, k_prev, v_prev)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _init(m):
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(_init)
        std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
        for blk in self.model.layers:
            nn.init.normal_(blk.self_attn.o_proj.weight, std=std)
            nn.init.normal_(blk.mlp.down_proj.weight, std=std)

    def hidden(self, ids, caches=None, offset=0):
        """The trunk's output after the final norm (B, T, H): what MTP layers read."""
        cos, sin = rope(self.cfg, offset, ids.shape[1])
        x = self.model.embed_tokens(ids)
        for i, blk in enumerate(self.model.layers):
            x = blk(x, cos, sin, None if caches is None else caches[i])
        return self.model.norm(x)

    def forward(self, ids, caches=None, offset=0):
        """Logits of every position.  ``caches`` (one [None] list per layer, filled in
        place) and ``offset`` (tokens already cached) give KV-cached decoding."""
        return self.lm_head(self.hidden(ids, caches, offset))


def build_model(cfg: LlamaConfig):
    return LlamaForCausalLM(cfg)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# --- the MTP head --------------------------------------------------------------------

class SharedHead(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """enorm, hnorm, eh_proj, block.* (one Llama decoder layer of shape ``cfg``), shared_head.norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(cfg)
        self.shared_head = SharedHead(cfg)
        self.apply(_init)
        nn.init.normal_(self.block.self_attn.o_proj.weight, std=0.02 / math.sqrt(2))
        nn.init.normal_(self.block.mlp.down_proj.weight, std=0.02 / math.sqrt(2))

    def _input(self, embeds, hidden):
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))

    def forward(self, embeds, hidden, offset=0, cache=None):
        """Pairs (h_i, e(x_{i+1})) at positions offset.. -> g (B, T, H). The caller zeroes the
        embedding of a sequence's first pair. ``cache``: a [None] list, filled as in Attention."""
        cos, sin = rope(self.cfg, offset, embeds.shape[1])
        return self.shared_head.norm(self.block(self._input(embeds, hidden), cos, sin, cache))

    def chained(self, embeds, g_prev, k_prev, v_prev):
        """Depth 2 for every position at once: query i = (g_i, e(drafted token)) at position
        i + 1, seeing the true pairs' keys 0..i (``k_prev``, ``v_prev`` from ``forward``'s cache)."""
        cos, sin = rope(self.cfg, 1, embeds.shape[1])
        x = self._input(embeds, g_prev)
        return self.shared_head.norm(self.block.chained(x, cos, sin, k_prev, v_prev))


def init_mtp_from_target(head: MTPHead, target: LlamaForCausalLM):
    """Start the head's layer from the target's last layer (MLP channels cut to the head's
    width) and its output norm from the target's final norm; eh_proj passes the hidden half."""
    last = target.model.layers[-1]
    f = head.cfg.intermediate_size
    with torch.no_grad():
        for name, p in head.block.named_parameters():
            src = dict(last.named_parameters())[name]
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                src = src[:f]
            elif name.endswith("down_proj.weight"):
                src = src[:, :f]
            p.copy_(src)
        head.shared_head.norm.weight.copy_(target.model.norm.weight)
        d = head.cfg.hidden_size
        head.eh_proj.weight[:, d:].copy_(torch.eye(d) + 0.02 * torch.randn(d, d))
