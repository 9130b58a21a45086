"""A head that drafts from the target's hidden states, chaining its own outputs (MTP, EAGLE-3).

The head sees pairs (h_i, x_{i+1}): what the target computed at position i and the token
after it. The loop hands it every such pair the target produced (`follow`: prefill chunks,
the kept positions of a verify pass, plain steps); they are queued and fed in one pass at the
next proposal. Its output at the last pair drafts d1; each further draft feeds its own output
back with the token just drafted (depth 2..k).

Its KV cache holds exactly one entry per pair, i.e. as many as the target cache holds
tokens. The k - 1 chained steps of a proposal add entries made from the head's own outputs,
not the target's; `commit` trims them all (host metadata), and the accepted positions come
back through `follow` with the target's hidden states, as vLLM and mlx-vlm do.

One row or a batch: `feed` and `chain` are the whole computation, over rows (B, ...), and
the batch (batch/mtp.py) runs them too, its rows' queues padded into one pass. A head (the
MTP head, mtp/heads.py `MTPHead`; an EAGLE-3 head's `Eagle3Pairs`, drafters/eagle3.py)
gives `embed` (token ids (B, T) -> embeddings), `block` (embeddings, states (B, T, H),
its cache layer -> outputs (B, T, H)) and `logits`. A drafter says how the target's states
enter the head (`states`: as they are, or fused); the rest is here, with the timing of one
chained step the policy reads as the head's cost per draft (`step_seconds`).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import mlx.core as mx

from ..attention import round_attention
from ..cache import rewind
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from .chain import draft_chain
from .protocol import Proposal
from .waiting import joined


def feed(head, tokens: mx.array, states: mx.array, layer) -> mx.array:
    """Pairs into the head, every row at once: token ids (B, T), the states before them
    (B, T, H) -> the head's outputs (B, T, H), lazy; its cache layer gains T entries a row."""
    return head.block(head.embed(tokens), states, layer)


def chain(head, g: mx.array, layer, k: int,
          draw: Callable[[mx.array, int], mx.array]) -> List[mx.array]:
    """k drafts for every row from its last output g (B, H) (chain.draft_chain): draft i is
    `draw(logits (B, V), i)` (target ids (B,), queued by `draw`); each but the last is fed back
    with the output it came from (depth i + 2), so the cache layer gains k - 1 entries a row."""

    def step(y: mx.array) -> mx.array:
        nonlocal g
        g = feed(head, y[:, None], g[:, None], layer)[:, 0]
        return head.logits(g)

    return draft_chain(head.logits(g), k, step, draw)


class HeadChainDrafter:
    source: str
    follows_target = True  # the loop hands it the target's hidden states (`follow`)
    keep_logprobs = False  # True: each proposal's per-step log q in kept_logprobs (a tree's)
    kept_logprobs: Optional[mx.array] = None  # (k, V) of the last proposal, lazy

    def __init__(self, head, sampling: SamplingConfig):
        self.head = head
        self.sampling = sampling
        self.cache = head.make_cache()
        self._tokens: List[int] = []  # queued: the tokens after the queued hidden states
        self._hidden: List[mx.array] = []  # queued: (m, H_target) blocks of target states
        self._last: Optional[mx.array] = None  # (H,) output at the last pair fed: drafts d1
        self._chained = 0  # cache entries the last proposal's chained steps added

    def states(self, hidden: mx.array) -> mx.array:
        """What the head takes for the target's states (m, H_target): those states."""
        return hidden

    def fed(self, outputs: mx.array) -> None:
        """The head's outputs (m, H) at the pairs a catch-up fed (a hook; nothing here)."""

    def follow(self, tokens: List[int], hidden: mx.array) -> None:
        """The target's hidden states (len(tokens), H_target) and the token after each position."""
        self._tokens.extend(tokens)
        self._hidden.append(hidden)

    def catch_up(self) -> list:
        """Feed the queued pairs (lazily, one pass); returns the arrays that hold the result."""
        if self._tokens:
            hidden = joined(self._hidden)
            g = feed(self.head, mx.array(self._tokens, mx.uint32)[None],
                     self.states(hidden)[None], self.cache[0])[0]  # (m, H)
            self._last = g[-1]
            self.fed(g)
            self._tokens, self._hidden = [], []
        return [c.state for c in self.cache] + ([self._last] if self._last is not None else [])

    def can_propose(self, history: List[int]) -> bool:
        return self._last is not None or bool(self._tokens)

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        with round_attention():  # the catch-up is a short multi-token pass
            self.catch_up()
        if self._last is None:  # nothing seen yet (a one-token prompt): a plain step first
            return None
        draft_probs, kept = [], []

        def draw(logits: mx.array, i: int) -> mx.array:
            draft_logprobs = logprobs_from_logits(logits[0], self.sampling)  # (V,)
            y = sample(draft_logprobs, self.sampling)[None]  # (1,) a target id
            if self.keep_logprobs:  # (a token tree's siblings: drafters/tree.py)
                kept.append(draft_logprobs)
            if not self.sampling.greedy:
                draft_probs.append(mx.exp(draft_logprobs))
            mx.async_eval(y, *draft_probs[-1:])
            return y

        draft_tokens = chain(self.head, self._last[None], self.cache[0], k, draw)
        self._chained = k - 1
        self.kept_logprobs = mx.stack(kept) if kept else None  # (k, V)
        probs = mx.stack(draft_probs) if draft_probs else None  # (k, V)
        return Proposal(mx.concatenate(draft_tokens), probs, self.source, self)

    def step_seconds(self, token: int, repeats: int = 2) -> Optional[float]:
        """Seconds of one chained step (the head on its last output and `token`, then its
        logits), undone each time; the fastest of `repeats`: what each draft after the first
        costs, known before any round (host syncs of its own). None before any pair was fed."""
        if self._last is None:
            return None
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            g = feed(self.head, mx.array([[token]], mx.uint32), self._last[None, None],
                     self.cache[0])
            mx.eval(self.head.logits(g[0, 0]))
            fastest = min(fastest, time.perf_counter() - start)
            rewind(self.cache, 1)
        return fastest

    def commit(self, num_accepted: int) -> None:
        """Drop the chained steps' entries; the kept positions return through `follow`."""
        rewind(self.cache, self._chained)
        self._chained = 0
