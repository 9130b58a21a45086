"""A verified chain judged: what the device ships to the host, and what the host reads back.

One sequence (loop.py) and every row of a batch (batch/verify.py) are judged by
the same two functions, so the greedy prefix match, the residual rule's draws
and the stop cut exist once:

    parts = verdict_parts(accept, drafts, probs, target_logits, target_logprobs)
    ... mx.concatenate(every row's parts).tolist()     # the round's one sync
    n, token, drafted, chances = read_verdict(values, k, greedy, with_chances)

Greedy acceptance compares on the host, as mlx-lm does: the target's k + 1
argmax tokens and the drafts come back in one transfer and the prefix match is
a Python loop (2-13% less main-thread time per round than the rule's graph on
a tiny pair: python -m bench.studies.round_overhead). The greedy argmax is
over the logits: log-softmax is monotone, so the token is the same. Every other
rule runs on the device and ships (n, token, drafts[, chances]).
"""

from __future__ import annotations

from typing import Collection, List, Optional, Sequence, Tuple

import mlx.core as mx

from .acceptance import (greedy_accept, speculative_accept,
                         speculative_accept_with_chances)
from .sampling import keyed_categorical

CHANCE_SCALE = 2**20  # a chance rides in the round's integer summary as chance * this


def verdict_parts(accept, drafts: mx.array, probs: Optional[mx.array], target_logits: mx.array,
                  target_logprobs: Optional[mx.array], key: Optional[mx.array] = None,
                  chances: bool = False) -> mx.array:
    """(size,) uint32, lazy: one chain's verdict as the host reads it (`read_verdict`).

    drafts (k,) uint32; probs (k, V) q (None when greedy); target_logits and
    target_logprobs (k + 1, V). `key`: the row's own random key, for a keyed rule
    (acceptance.keyed_rule: a batch row's draws do not depend on the others); with
    `chances` (the residual rule) each draft's chance of being kept rides along."""
    if accept is greedy_accept:
        return mx.concatenate([mx.argmax(target_logits, axis=-1).astype(mx.uint32),
                               drafts.astype(mx.uint32)])
    k = drafts.shape[0]
    kept = None
    if k == 0 and getattr(accept, "sampler", None) is not None:  # an opaque sampler's draw
        n, token = accept(drafts, probs, target_logprobs)  # (acceptance.sampler_match)
    elif k == 0:  # nothing to judge: the target's own draw
        n = mx.array(0)
        token = keyed_categorical(target_logprobs[0], key) if key is not None else \
            mx.random.categorical(target_logprobs[0])
    elif key is not None and chances:  # (a batch row alone: its policy reads them, as a
        # call's; the keyed rule's own, acceptance.KeyedRule, from the p it draws with)
        n, token, kept = accept.with_chances(drafts, probs, target_logprobs, key)
    elif key is not None:
        n, token = accept(drafts, probs, target_logprobs, key)
    elif chances and accept is speculative_accept:  # the same rule, its chances from one p
        n, token, kept = speculative_accept_with_chances(drafts, probs, target_logprobs)
    else:
        n, token = accept(drafts, probs, target_logprobs)
    parts = [n[None].astype(mx.uint32), token[None].astype(mx.uint32), drafts.astype(mx.uint32)]
    if kept is not None:  # as integers (a sharded target agrees on them too)
        parts.append(mx.round(mx.clip(kept, 0.0, 1.0) * CHANCE_SCALE).astype(mx.uint32))
    return mx.concatenate(parts)


def verdict_size(k: int, greedy: bool, chances: bool = False) -> int:
    """How many values `verdict_parts` ships for k drafts."""
    return 2 * k + 1 if greedy else 2 + k + (k if chances else 0)


def read_verdict(values: Sequence[int], k: int, greedy: bool, chances: bool = False
                 ) -> Tuple[int, int, List[int], Optional[List[float]]]:
    """(accepted n, the target's next token, the drafted tokens, each draft's chance or None)
    from `verdict_parts`' values (host ints)."""
    if greedy:
        target_tokens, drafted = values[:k + 1], list(values[k + 1:2 * k + 1])
        n = prefix_match(drafted, target_tokens)
        return n, target_tokens[n], drafted, None
    n, token = values[0], values[1]
    drafted = list(values[2:2 + k])
    kept = [c / CHANCE_SCALE for c in values[2 + k:2 + 2 * k]] if chances else None
    return n, token, drafted, kept


def prefix_match(drafted: Sequence[int], target_tokens: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    n = 0
    while n < len(drafted) and drafted[n] == target_tokens[n]:
        n += 1
    return n


def stop_cut(tokens: List[int], stop_tokens: Collection[int]) -> List[int]:
    """`tokens` up to and including the first stop token: nothing after it is kept."""
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[:i + 1]
    return tokens
