"""One request in a batch: its tokens so far, its budget, its sampling and its own random stream.

Everything a row needs between rounds lives here, on the host; the device
state of all rows lives in the batch caches (kv.py). A row's random key is
its own (from its seed, or drawn from MLX's global generator when it has
none), split every round, so a seeded row gives the same text whatever else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..defaults import DEFAULT_MAX_NGRAM, DEFAULT_NUM_DRAFT_TOKENS
from ..drafters.prompt_lookup import (PAIRED_MIN_NGRAM, PromptLookupDrafter,
                                      behind_by_default, on_by_default)
from ..drafters.suffix import SuffixDrafter, suffix_min_match
from ..drafters.tree import TreeDrafter
from ..sampling import SamplingConfig


@dataclass
class RowRequest:
    """What a caller asks of one row (`BatchEngine.insert`)."""

    prompt: List[int]
    max_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: Optional[int] = None
    prompt_lookup: Optional[bool] = None  # None: prompt_lookup.on_by_default (as the solo API)
    num_draft_tokens: Optional[int] = None  # pinned k for this row (0: never drafts)
    logits_processors: Sequence = ()
    logprobs: bool = False  # hand out the target's log-probabilities of each token
    suffix: object = None  # a SuffixIndex to draft from (suffix drafting), in front of lookup
    prompt_lookup_max_ngram: int = DEFAULT_MAX_NGRAM
    stop_tokens: Collection[int] = ()
    keep_cache: bool = False  # hand the row's cache back when it ends (the prompt-cache store)
    # (len(prompt), H): fed to the target in place of the prompt tokens' own embeddings (as
    # generate's input_embeddings); `prompt` holds the ids they stand for (the drafters read
    # them). The first token comes from the last one, as the row joins (BatchEngine._first_token)
    input_embeddings: Optional[mx.array] = None

    @property
    def chains_only(self) -> bool:
        """Whether the row drafts chains whatever tree the batch asks: logits processors (they
        are applied along a chain's positions) or an opaque sampler (trees need the residual
        rule's q)."""
        return bool(self.logits_processors) or self.sampling.sampler is not None


@dataclass
class Row:
    uid: int
    request: RowRequest
    history: List[int]  # prompt + emitted; the batch caches hold history[:-1]
    key: mx.array
    searchers: List  # host searches asked in order before the draft model: suffix, lookup
    stop_tokens: frozenset
    emitted: int = 0
    draft_pending: List[int] = field(default_factory=list)  # tokens the draft cache has not seen
    # The draft has not read the prompt: it waits until the row's policy first asks it for drafts
    # (engine._defers_draft; then one timed catch-up), as a call's lazily prefilled draft
    draft_waits: bool = False
    # MTP: (tokens, the target's hidden states before each) the head has not seen; whether
    # the row has had any pair (a one-token prompt has none before its first round)
    mtp_pending: list = field(default_factory=list)
    mtp_ready: bool = False
    # DFlash: the target's taps (n, taps * H) at kept positions the drafter has not read; whether
    # it has read any (as the MTP head's)
    dflash_pending: list = field(default_factory=list)
    dflash_ready: bool = False
    # A draft of another tokenizer: the row's own drafter (batch/cross.py), also its last search
    cross: object = None
    # Host searches asked after `searchers` only while the row decodes alone and the model
    # drafter sits out (the single-stream policy's fallback: prompt lookup at T > 0)
    fallbacks: List = field(default_factory=list)
    # The request's own acceptance (a policy.SourceEstimate, counted from its own rounds): what
    # the batch policy reads of it (batch/policy.py); set by the engine when it joins
    acceptance: object = None
    # The prompt look (prompt_look.py): {source: rows -> chances, lazy} from what a sampled
    # row's last prefill chunk kept (the target's and its drafter's rows at the prompt's last
    # positions), until its policy reads them; and its prefill's tokens and the target's time
    # on them (a head's or a DFlash drafter's included, a draft model's not: a call's timed
    # prefill), what the look's rows cost and its policy's prior of v
    look_tail: Optional[tuple] = None
    prefill_seconds: float = 0.0
    prefilled: int = 0
    # ... and the draft model's time on the prompt, where it read it then (a call's policy is
    # told it as the draft's catch-up price)
    draft_prefill_seconds: float = 0.0

    @property
    def room(self) -> int:
        return self.request.max_tokens - self.emitted

    @property
    def greedy(self) -> bool:
        return self.request.sampling.greedy

    @property
    def sampler(self):
        """The request's opaque sampler (SamplingConfig.sampler; None: temp/top_p/top_k/min_p):
        it draws the row's tokens itself, from MLX's global random state, and a draft is kept
        while it equals the sampler's draw (acceptance.sampler_match)."""
        return self.request.sampling.sampler

    @property
    def pinned(self) -> Optional[int]:
        """The row's own k, if it has one: its request's, or the default k for a seeded sampled
        row (its random stream, and so its text, then never depends on the batch)."""
        pinned = self.request.num_draft_tokens
        if pinned is None and self.request.seed is not None and not self.greedy:
            pinned = DEFAULT_NUM_DRAFT_TOKENS
        return pinned

    def wants(self, k: int) -> int:
        """How many drafts this row verifies in a round of the batch's k: its pinned k if it
        has one, else k; never past its budget."""
        pinned = self.pinned
        return min(self.room, k if pinned is None else pinned)

    def next_key(self) -> mx.array:
        self.key, sub = _split(self.key)
        return sub


@mx.compile
def _split(key: mx.array):
    """mx.random.split(key) as (key, sub), compiled (one graph node where uncompiled it is three)."""
    key, sub = mx.random.split(key)
    return key, sub


def make_row(uid: int, request: RowRequest, vocab_size: int, stop_tokens: Collection[int],
             has_draft_model: bool, tree: Optional[Tuple[int, int]] = None) -> Row:
    """A row for `request`; with `tree` (depth, width) its prompt lookup and suffix drafting
    propose tries of the earlier text's continuations (drafters/tree.TreeDrafter), unless its
    logits processors ask for chains (they are applied along a chain's positions)."""
    sampling = request.sampling
    seeded = request.seed is not None
    use_lookup = request.prompt_lookup if request.prompt_lookup is not None else \
        on_by_default(has_draft_model, sampling.greedy, seeded=seeded)
    searchers = []
    history = list(request.prompt)
    if request.num_draft_tokens != 0:
        if request.suffix is not None:
            suffix = SuffixDrafter(request.suffix, vocab_size, sampling.greedy,
                                   min_match=suffix_min_match(use_lookup, has_draft_model))
            suffix.attach(history)  # the row's text joins the index as it grows
            searchers.append(suffix)
        if use_lookup:
            min_ngram = PAIRED_MIN_NGRAM if has_draft_model else 1
            searchers.append(PromptLookupDrafter(vocab_size, sampling.greedy,
                                                 max_ngram=request.prompt_lookup_max_ngram,
                                                 min_ngram=min(min_ngram,
                                                               request.prompt_lookup_max_ngram)))
    if tree is not None and not request.chains_only:
        searchers = [TreeDrafter(searcher, *tree) for searcher in searchers]
    fallbacks = []
    if request.prompt_lookup is None and request.num_draft_tokens is None and \
            behind_by_default(has_draft_model, sampling.greedy, seeded):  # as assemble.py's
        fallbacks.append(PromptLookupDrafter(vocab_size, sampling.greedy,
                                             max_ngram=request.prompt_lookup_max_ngram))
    if request.seed is not None:
        key = mx.random.key(request.seed)
    else:
        key = mx.random.key(int(mx.random.randint(0, 2**31 - 1, ()).item()))
    stops = frozenset(stop_tokens) | frozenset(request.stop_tokens)
    return Row(uid, request, history, key, searchers, stops, fallbacks=fallbacks)


@dataclass(frozen=True)
class RowOutput:
    """What one round gave one row."""

    uid: int
    tokens: List[int]
    finish_reason: Optional[str]  # "stop", "length", or None while the row goes on
    num_drafted: int
    num_accepted: int
    source: str  # "draft", "lookup", "suffix" or "target" (no drafts this round)
    logprobs: Optional[mx.array] = None  # (len(tokens), V) the target's own, lazy; if asked
    cache: Optional[list] = None  # at the end, with keep_cache: target layers + draft layers
    stats: object = None  # the request's GenerationStats so far, where the engine keeps them
    cross_rule: Optional[str] = None  # a draft of another tokenizer: "string" or "intersection"
    tree_nodes: int = 0  # a token tree's round: the nodes verified (num_drafted: its depth)
    tree_width: int = 1  # ... its widest node
    spine_kept: Optional[int] = None  # ... the draft model's own drafts kept
    spine_length: Optional[int] = None  # ... and drafted
    opens_block: bool = False  # the first round of a plain block (batch/plain.py), as Round's
    # A row alone's sampled chain: each draft's chance of being kept (its policy reads them)
    chances: Optional[List[float]] = None
