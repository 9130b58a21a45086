"""The prompt look: a drafter's acceptance measured on the prompt's last tokens, before any round.

The prefill already ran the target and each model drafter over the prompt.
At its last positions both predicted tokens that are known, so each
position's chance that the residual rule keeps a draft there is
sum_x min(p(x), q(x)) under the sampling transform of the round. Their mean,
over up to ROWS positions, is the source's starting acceptance estimate in
place of a guess (policy.AdaptivePolicy.observe_prompt_look). Greedy the
policy does not look: a target's own greedy continuation is easier to guess
than its prompt, so the prompt's argmax agreement is no prior
(bench/results/prompt-look-accuracy.md).

The cost: the target's and each drafter's last layer over the prefill's last
chunk and output layer over the rows, and one host sync. The rows are
gathered lazily right after the prefill and evaluated after the first round
(loop._take_look): the first token does not wait, and a source already off
then is not computed. A batch row decoding alone looks too, with a draft model,
the target's MTP head or a block drafter (batch/engine.py, `_take_look`: the last
prefill chunk's hidden states, the head's outputs at its pairs, or a sequence's
block drafter over the row's context, the same chances, after its first round
alone). How many rows: as many as a share of the reply's plain
time buys (policy.AdaptivePolicy.look_rows), the look's cost read in the target's prefill
time per prompt token, which the loop times: about 8 tokens' worth plus 0.4 a
row on this project's CPU pairs, where a prompt token costs 0.16-0.34 of a plain
step with the reference BLAS and 0.08-0.17 with OpenBLAS. The target's, a draft
model's and an MTP head's output layers run only over the rows asked for (a
Tail); a block drafter's rows are built whole. Only the policy reads the
result; no token depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx

from .cache import ModelCache
from .mtp.heads import split_target
from .sampling import SamplingConfig, probs_from_logits

ROWS = 32  # prompt positions compared, at most
MIN_ROWS = 4  # fewer (a short prompt, a reused cache, a dear look): no look


@dataclass(frozen=True)
class Tail:
    """The last `count` rows of a forward's logits (or a drafter's q), each computed only when
    asked for: `rows(r)` gives the last min(r, count), lazily."""

    count: int
    rows: Callable[[int], mx.array]

    @staticmethod
    def of(logits: Optional[mx.array]) -> Optional["Tail"]:
        """An array already built (its rows computed together)."""
        return None if logits is None else Tail(logits.shape[0], lambda r: _last(logits, r))

    @staticmethod
    def through(hidden: mx.array, head: Callable[[mx.array], mx.array], rows: int) -> "Tail":
        """`head` over the last r <= `rows` of `hidden`, run only over the rows asked for."""
        hidden = _last(hidden, rows)
        return Tail(hidden.shape[0], lambda r: head(_last(hidden, r)))

    def at_most(self, rows: int) -> "Tail":
        """The same rows, no more than the last `rows` of them."""
        return Tail(min(rows, self.count), lambda r: self.rows(min(r, rows)))


def keep_hidden(cache: ModelCache) -> bool:
    """Make `cache` keep the hidden states of its forwards (its model split into trunk and
    head; the cache's contents are the same; a block drafter's target keeps them beside its
    taps, in `final`). True when it was split here (undo with `drop_hidden`); False when it
    already keeps them or cannot (a model without mlx-lm's trunk-and-head layout)."""
    if cache.split is not None:
        return False
    try:
        cache.split = split_target(cache.model)
    except (AttributeError, KeyError, TypeError):
        return False
    return True


def drop_hidden(cache: ModelCache) -> None:
    cache.split, cache.final = None, None
    if cache.capture is None:  # (a capture's hidden states are its taps)
        cache.hidden = None


def tail_logits(cache: ModelCache, rows: int) -> Optional[Tail]:
    """The logits of the last r <= `rows` positions of the cache's last forward, from its kept
    hidden states, the output layer run only over the rows asked for; None when it kept none."""
    hidden = cache.final if cache.capture is not None else cache.hidden
    if cache.split is None or hidden is None or hidden.shape[0] < 1:
        return None
    return Tail.through(hidden, cache.split[1], rows)


def _last(x: mx.array, r: int) -> mx.array:
    """x's last r rows (all when r is more; none when 0)."""
    return x[max(x.shape[0] - r, 0):]


def chances(target_logits: mx.array, draft_logits: mx.array, sampling: SamplingConfig,
            draft_probs: bool = False) -> mx.array:
    """(r,) each position's chance the residual rule keeps the draft's proposal there (greedy:
    1 where the argmaxes agree, else 0), for logits aligned on their last rows (the longer one
    cut); `draft_probs`: the draft's rows are q itself (a DFlash2 selector's), not logits."""
    rows = min(target_logits.shape[0], draft_logits.shape[0])
    target_logits, draft_logits = target_logits[-rows:], draft_logits[-rows:]
    vocab, pad = target_logits.shape[-1], target_logits.shape[-1] - draft_logits.shape[-1]
    if pad > 0:  # a draft vocabulary padded shorter than the target's: those tokens never drafted
        draft_logits = mx.pad(draft_logits, [(0, 0), (0, pad)],
                              constant_values=0.0 if draft_probs else -mx.inf)
    draft_logits = draft_logits[:, :vocab]
    if sampling.greedy:
        return (target_logits.argmax(axis=-1) == draft_logits.argmax(axis=-1)).astype(mx.float32)
    p = probs_from_logits(target_logits, sampling)
    q = draft_logits if draft_probs else probs_from_logits(draft_logits, sampling)
    return mx.minimum(p, q).sum(axis=-1)


def offers(drafter) -> bool:
    """Whether a drafter offers its prompt rows: `prompt_logits(rows)` or, when its q is not a
    transform of logits, `prompt_probs(rows)` (either None: it cannot)."""
    return getattr(drafter, "prompt_logits", None) is not None or \
        getattr(drafter, "prompt_probs", None) is not None


def gather(target_tail: Optional[Tail], drafters, sampling: SamplingConfig
           ) -> Dict[str, Callable[[int], mx.array]]:
    """{source: rows -> (r,) chances at the last r positions, lazy} for each drafter that
    offers its prompt rows (predicting the same last prompt tokens as `target_tail`: see
    `offers`), taken right after the prefill (a drafter's rows are its state's then: a
    drafter's `prompt_logits` may give a Tail, its output layer run later over the rows asked
    for, or an array); nothing is computed until `look`."""
    pending = {}
    for drafter in drafters:  # each asked once, even with no target rows: it lets its go
        if not offers(drafter):
            continue
        as_probs = getattr(drafter, "prompt_logits", None) is None
        draft_tail = (drafter.prompt_probs if as_probs else drafter.prompt_logits)(ROWS)
        if not isinstance(draft_tail, Tail):
            draft_tail = Tail.of(draft_tail)
        if draft_tail is not None and draft_tail.count >= MIN_ROWS \
                and target_tail is not None and target_tail.count >= MIN_ROWS:
            most = min(draft_tail.count, target_tail.count)
            pending[drafter.source] = chances_of(target_tail, draft_tail, most, sampling,
                                                  as_probs)
    return pending


def chances_of(target_tail: Tail, draft_tail: Tail, most: int, sampling: SamplingConfig,
               as_probs: bool = False) -> Callable[[int], mx.array]:
    """rows -> (r,) chances at the last r <= `most` positions of the two tails, lazily."""
    return lambda r: chances(target_tail.rows(min(r, most)), draft_tail.rows(min(r, most)),
                             sampling, as_probs)


def look(pending: Dict[str, Callable[[int], mx.array]],
         wanted: Callable[[str], bool] = lambda source: True, rows: int = ROWS
         ) -> Dict[str, tuple]:
    """{source: (mean chance, positions)} over the last `rows` positions (at most) for each
    gathered source still `wanted`; the others, and the rows not asked for, are never
    computed. Fewer than MIN_ROWS rows: no look."""
    if rows < MIN_ROWS:
        return {}
    chosen = {source: of(rows) for source, of in pending.items() if wanted(source)}
    if not chosen:
        return {}
    means = {source: c.mean() for source, c in chosen.items()}
    mx.eval(list(means.values()))  # the look's one host sync
    return {source: (means[source].item(), chosen[source].shape[0]) for source in chosen}
