"""One request in a batch: its tokens so far, its budget, its sampling and its own random stream.

Everything a row needs between rounds lives here, on the host; the device
state of all rows lives in the batch caches (kv.py). A row's random key is
its own (from its seed, or drawn from MLX's global generator when it has
none), split every round, so a seeded row gives the same text whatever else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, List, Optional, Sequence

import mlx.core as mx

from ..drafters.prompt_lookup import PAIRED_MIN_NGRAM, PromptLookupDrafter
from ..sampling import SamplingConfig


@dataclass
class RowRequest:
    """What a caller asks of one row (`BatchEngine.insert`)."""

    prompt: List[int]
    max_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: Optional[int] = None
    prompt_lookup: Optional[bool] = None  # None: on at temp 0, off otherwise (as the solo API)
    num_draft_tokens: Optional[int] = None  # pinned k for this row (0: never drafts)
    logits_processors: Sequence = ()
    logprobs: bool = False  # hand out the target's log-probabilities of each token
    stop_tokens: Collection[int] = ()
    keep_cache: bool = False  # hand the row's cache back when it ends (the prompt-cache store)


@dataclass
class Row:
    uid: int
    request: RowRequest
    history: List[int]  # prompt + emitted; the batch caches hold history[:-1]
    key: mx.array
    lookup: Optional[PromptLookupDrafter]
    stop_tokens: frozenset
    emitted: int = 0
    draft_pending: List[int] = field(default_factory=list)  # tokens the draft cache has not seen

    @property
    def room(self) -> int:
        return self.request.max_tokens - self.emitted

    @property
    def greedy(self) -> bool:
        return self.request.sampling.greedy

    def wants(self, k: int) -> int:
        """This row's share of a round of k drafts (its pinned k caps it)."""
        pinned = self.request.num_draft_tokens
        return min(k, self.room, k if pinned is None else pinned)

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def make_row(uid: int, request: RowRequest, vocab_size: int, stop_tokens: Collection[int],
             has_draft_model: bool) -> Row:
    sampling = request.sampling
    use_lookup = request.prompt_lookup if request.prompt_lookup is not None else sampling.greedy
    lookup = None
    if use_lookup and request.num_draft_tokens != 0:
        min_ngram = PAIRED_MIN_NGRAM if has_draft_model else 1
        lookup = PromptLookupDrafter(vocab_size, sampling.greedy, min_ngram=min_ngram)
    if request.seed is not None:
        key = mx.random.key(request.seed)
    else:
        key = mx.random.key(int(mx.random.randint(0, 2**31 - 1, ()).item()))
    stops = frozenset(stop_tokens) | frozenset(request.stop_tokens)
    return Row(uid, request, list(request.prompt), key, lookup, stops)


@dataclass(frozen=True)
class RowOutput:
    """What one round gave one row."""

    uid: int
    tokens: List[int]
    finish_reason: Optional[str]  # "stop", "length", or None while the row goes on
    num_drafted: int
    num_accepted: int
    source: str  # "draft", "lookup" or "target" (no drafts this round)
    logprobs: Optional[mx.array] = None  # (len(tokens), V) the target's own, lazy; if asked
    cache: Optional[list] = None  # at the end, with keep_cache: target layers + draft layers
