"""DFlash2's additions to the drafter: dynamic causal convolutions and a candidate selector.

What a published `DFlash2DraftModel` computes (read from z-lab's public MLX
reference and other public ports of it; this is our own code):

- every layer is a DFlash layer whose attention and MLP sublayers each sit
  inside a grouped dynamic causal convolution over the block's positions:
  one projection of the sublayer's (normed) input gives, per position, two
  sets of K tap weights per channel group; the input is convolved with the
  first set (plus `base_kernel[0]`), the sublayer's output with the second
  (plus `base_kernel[1]`), and the result joins the residual stream:

      out[t, c] = sum_{o < K} (base[side, o, c] + dynamic[t, side, o, c // group]) * x[t - o, c]

  with x[t - o] = 0 before the block's first position (the context never
  enters a convolution; it still enters attention only as keys and values).
- logits: the target's head over the normed block rows, times
  `output_multiplier`, then soft-capped (`cap * tanh(x / cap)`) when set. A
  config left at the defaults (multiplier 1, no cap) takes the target's own
  `output_multiplier` and `final_logit_softcapping` when its args have them
  (Muse Glimmer / Spark: their head's raw output is not their logits), as the
  reference's `bind` does.
- the candidate selector walks the drafts left to right from the block's first
  token (the last known one): at position i it takes the `selector_top_k`
  largest logits as candidates and scores each candidate c as

      score(c) = logit(c) + < predecessor_codebook[prev] * hidden_projection(h_i),
                              successor_codebook[c] >

  where prev is the token chosen at i - 1. Greedy: the best score. At a
  temperature T > 0 the draft is drawn from softmax(score / T) over the
  candidates only, so q is zero outside them (see `CandidateSelector.walk`).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .config import DFlash2Parts, DFlashConfig
from .model import DFlashLayer, DFlashModel


class GroupedDynamicCausalConv(nn.Module):
    """`base_kernel` (2, K, H): per channel, for the input side (0) and the output side (1);
    `kernel_projection` H -> 2 * K * groups: the per-position, per-group additions."""

    def __init__(self, hidden_size: int, parts: DFlash2Parts):
        super().__init__()
        self.taps, self.group_size = parts.conv_kernel_size, parts.conv_group_size
        self.groups = hidden_size // self.group_size
        self.base_kernel = mx.zeros((2, self.taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.taps * self.groups, bias=False)
        self.skipped = False  # set once the weights are in (`skip_if_pass_through`)

    def passes_through(self) -> bool:
        """One tap of weight 1 and no dynamic part: out = x on both sides (a DFlash drafter
        written as DFlash2, e.g. training.dflash_selector's)."""
        return self.taps == 1 and bool(mx.all(self.base_kernel == 1)) and \
            bool(mx.all(self.kernel_projection.weight == 0))

    def skip_if_pass_through(self) -> None:
        """Skip the computation when it would hand its input on unchanged (the same bits:
        (1 + 0) * x is x)."""
        self.skipped = self.passes_through()

    def prepare(self, x: mx.array) -> Tuple[mx.array, Optional[mx.array]]:
        """The sublayer's input x (1, B, H) convolved, and the output side's dynamic taps."""
        if self.skipped:
            return x, None
        B, T, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(B, T, 2, self.taps, self.groups)
        return self.convolve(x, dynamic[:, :, 0], 0), dynamic[:, :, 1]

    def convolve(self, x: mx.array, dynamic: mx.array, side: int) -> mx.array:
        """x (1, B, H) with taps base_kernel[side] + dynamic (1, B, K, groups), causally."""
        if self.skipped:
            return x
        B, T, H = x.shape
        grouped = x.reshape(B, T, self.groups, self.group_size)
        base = self.base_kernel[side].reshape(self.taps, self.groups, self.group_size)
        out = mx.zeros_like(grouped)
        for offset in range(min(self.taps, T)):  # x[t - offset], zero before the block
            shifted = grouped if offset == 0 else mx.pad(grouped[:, :T - offset],
                                                         [(0, 0), (offset, 0), (0, 0), (0, 0)])
            weight = base[offset].astype(x.dtype) + dynamic[:, :, offset, :, None]
            out = out + weight * shifted  # (1, B, groups, group_size)
        return out.reshape(B, T, H)


class DFlash2Layer(DFlashLayer):
    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, config.dflash2)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.dflash2)

    def __call__(self, x, context_keys, context_values, offset, mask):
        h, after = self.attention_conv.prepare(self.input_layernorm(x))
        h = self.self_attn(h, context_keys, context_values, offset, mask)
        x = x + self.attention_conv.convolve(h, after, 1)
        h, after = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.convolve(self.mlp(h), after, 1)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, parts: DFlash2Parts):
        super().__init__()
        self.top_k = parts.selector_top_k
        # stored as plain arrays, as published (no `.weight`)
        self.predecessor_codebook = mx.zeros((parts.vocab_size, parts.selector_rank))
        self.successor_codebook = mx.zeros((parts.vocab_size, parts.selector_rank))
        self.hidden_projection = nn.Linear(hidden_size, parts.selector_rank, bias=False)

    def candidates(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        """(candidates (..., K), their logits (..., K) in float32): each row's top_k tokens."""
        candidates = mx.argpartition(-logits, self.top_k - 1, axis=-1)[..., :self.top_k]
        return candidates, mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)

    def logprobs(self, hidden: mx.array, logits: mx.array, previous: mx.array,
                 temp: float) -> mx.array:
        """log q (..., V), lazy: for normed rows hidden (..., H) with logits (..., V), each
        after its token `previous` (...), softmax(score / temp) over the row's candidates,
        -inf outside them (the walk's q for a row drawn after that token). A sequence's
        (drafters/dflash2.py: its prompt look, its trees' siblings) and a batch's rows' (their
        trees' siblings, batch/dflash.py)."""
        candidates, unary = self.candidates(logits)  # (..., K)
        scores = selector_scores(self, candidates, unary, self.hidden_projection(hidden),
                                 previous)  # (..., K)
        logq = nn.log_softmax(scores * (1.0 / temp), axis=-1)
        outside = mx.full(logits.shape, -mx.inf, mx.float32)
        return mx.put_along_axis(outside, candidates, logq, axis=-1)

    def walk(self, hidden: mx.array, logits: mx.array, previous: mx.array,
             temps: Sequence[float], drawn: Sequence[int],
             key_for: Callable[[int, int], Optional[mx.array]] = lambda row, i: None
             ) -> Tuple[mx.array, List[Optional[mx.array]]]:
        """Drafts along each row's block from its last known token `previous` (B,): hidden
        (B, k, H) normed rows and their logits (B, k, V). Row j's first drawn[j] drafts are
        drawn at temps[j] > 0 from softmax(score / T) over the candidates, with key
        key_for(j, i) (None: MLX's global generator), and q_j gets a row per draw: the
        distribution it was drawn from (zero outside that row's candidates; it depends on
        the token drawn before it, which the acceptance rule allows). Every other draft is the
        best score. Returns the tokens (B, k) and each row's q (drawn[j], V), or None. One walk
        for a sequence (B = 1) and a batch's rows."""
        _, k, V = logits.shape
        candidates, unary = self.candidates(logits)  # (B, k, K)
        projected = self.hidden_projection(hidden)  # (B, k, rank)
        tokens, q = [], [[] for _ in temps]
        for i in range(k):
            scores = selector_scores(self, candidates[:, i], unary[:, i], projected[:, i],
                                     previous)  # (B, K)
            best = mx.argmax(scores, axis=-1)
            picks = []
            for j, temp in enumerate(temps):
                if temp <= 0 or i >= drawn[j]:
                    picks.append(best[j])
                    continue
                scaled = scores[j] * (1.0 / temp)
                picks.append(mx.random.categorical(scaled, key=key_for(j, i)))
                q[j].append(mx.put_along_axis(mx.zeros((V,), mx.float32), candidates[j, i],
                                              mx.softmax(scaled), axis=-1))
            previous = mx.take_along_axis(candidates[:, i], mx.stack(picks)[:, None],
                                          axis=-1)[:, 0].astype(mx.uint32)
            tokens.append(previous)
        return mx.stack(tokens, axis=1), [mx.stack(rows) if rows else None for rows in q]


def selector_scores(selector, candidates: mx.array, unary: mx.array, projected: mx.array,
                    previous: mx.array) -> mx.array:
    """The selector's scores (..., K) of candidates (..., K) whose logits are `unary`, after
    the tokens `previous` (...), the rows' hidden states projected (..., rank):
    unary + < predecessor_codebook[previous] * projected, successor_codebook[candidates] >.
    One computation for a walk alone, a batch's rows and training."""
    context = selector.predecessor_codebook[previous] * projected  # (..., rank)
    pairwise = selector.successor_codebook[candidates] @ context[..., None]  # (..., K, 1)
    return unary.astype(mx.float32) + pairwise[..., 0].astype(mx.float32)


class DFlash2Model(DFlashModel):
    """A DFlash2 drafter's own weights: DFlash's plus the convolutions and the selector."""

    layer_class = DFlash2Layer

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.dflash2)

    def convolutions(self):
        return [conv for layer in self.layers for conv in (layer.attention_conv, layer.mlp_conv)]

    def loaded(self) -> None:
        """After its weights are in: convolutions that pass their input through are skipped."""
        for conv in self.convolutions():
            conv.skip_if_pass_through()


def draft_logits(head_output: mx.array, multiplier: float, cap: Optional[float]) -> mx.array:
    """The drafter's logits from the target head's output over its rows: times `multiplier`,
    then soft-capped to (-cap, cap) when a cap is set."""
    logits = head_output.astype(mx.float32)
    if multiplier != 1.0:
        logits = logits * multiplier
    if cap is not None:
        logits = mx.tanh(logits / cap) * cap
    return logits
