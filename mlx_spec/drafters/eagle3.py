"""Proposals from an EAGLE-3 head: it drafts from three tapped target layers, fused.

The loop hands it the target's taps (low, mid, high layer outputs side by side) at every
position the target keeps, with the token after each (`follow`: prefill chunks, the kept rows
of a verify pass, plain steps); they are queued and fed in one pass at the next proposal: the
pair (h_i, x_{i+1}) enters as fc(h_i) with the embedding of x_{i+1}. The head's output at the
last pair drafts d1; each further draft feeds the head's own pre-norm output back, with the
embedding of the token just drafted (no fc: EAGLE's cnets.py, vLLM, SGLang).

Its KV cache holds one entry per pair, as many as the target cache holds tokens. The k - 1
chained steps add entries made from its own outputs; `commit` trims them all (host metadata)
and the accepted positions come back through `follow` with the target's taps.

q for the acceptance rule: the head's logits over the draft vocabulary placed at their target
ids (draft id d is target id d + d2t[d]), -inf elsewhere, then the target's own sampling
transform: q is zero outside the draft vocabulary, and the residual max(p - q, 0) covers the
target's whole vocabulary (acceptance.py).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ..attention import round_attention
from ..cache import rewind
from ..dflash.taps import embedding
from ..eagle3.model import Eagle3Head
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from .protocol import Proposal


class Eagle3Drafter:
    source = "eagle3"
    follows_target = True  # the loop hands it the target's taps (`follow`)

    def __init__(self, head: Eagle3Head, target_model, sampling: SamplingConfig):
        self.head = head
        self.sampling = sampling
        self.embed = head.embed_tokens if "embed_tokens" in head else embedding(target_model)
        self.cache = head.make_cache()
        self._tokens: List[int] = []  # queued: the tokens after the queued taps
        self._taps: List[mx.array] = []  # queued: (m, 3 * H) blocks of target taps
        self._last: Optional[mx.array] = None  # (H,) output at the last pair fed: drafts d1
        self._chained = 0  # cache entries the last proposal's chained steps added

    def follow(self, tokens: List[int], hidden: mx.array) -> None:
        """The target's taps (len(tokens), 3 * H) and the token after each position."""
        self._tokens.extend(tokens)
        self._taps.append(hidden)

    def catch_up(self) -> list:
        """Feed the queued pairs (lazily, one pass); returns the arrays that hold the result."""
        if self._tokens:
            taps = self._taps[0] if len(self._taps) == 1 else mx.concatenate(self._taps)
            fused = self.head.fuse(taps.astype(self.head.fc.weight.dtype))  # (m, H)
            g = self.head(self.embed(mx.array(self._tokens, mx.uint32)), fused, self.cache[0])
            self._last = g[-1]
            self._tokens, self._taps = [], []
        return [c.state for c in self.cache] + ([self._last] if self._last is not None else [])

    def can_propose(self, history: List[int]) -> bool:
        return self._last is not None or bool(self._tokens)

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        with round_attention():  # the catch-up is a short multi-token pass
            self.catch_up()
        if self._last is None:  # nothing seen yet (a one-token prompt): a plain step first
            return None
        g, draft_tokens, draft_probs = self._last, [], []
        for i in range(k):
            draft_logprobs = logprobs_from_logits(self.head.logits(g), self.sampling)  # (V,)
            y = sample(draft_logprobs, self.sampling)[None]  # (1,) a target id
            if not self.sampling.greedy:
                draft_probs.append(mx.exp(draft_logprobs))
            draft_tokens.append(y)
            if i + 1 < k:  # depth i + 2: its own output with the token it drafted
                g = self.head(self.embed(y), g[None], self.cache[0])[0]
            mx.async_eval(y, *draft_probs[-1:])
        self._chained = k - 1
        probs = mx.stack(draft_probs) if draft_probs else None  # (k, V)
        return Proposal(mx.concatenate(draft_tokens), probs, self.source, self)

    def commit(self, num_accepted: int) -> None:
        """Drop the chained steps' entries; the kept positions return through `follow`."""
        rewind(self.cache, self._chained)
        self._chained = 0
