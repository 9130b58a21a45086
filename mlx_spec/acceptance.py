"""Accept/reject rules: which drafted tokens the target keeps, and what comes next.

Notation as in the papers (Leviathan et al. 2023, Chen et al. 2023):
p = target distribution, q = draft distribution, x_i = i-th drafted token.

Each rule takes, for a round with k drafted tokens,
    draft_tokens     (k,)      uint32
    draft_probs      (k, V)    q, probabilities (one-hot for deterministic drafts)
    target_logprobs  (k+1, V)  log p at every verified position
and returns, still lazy on device,
    num_accepted     ()        n in [0, k]
    next_token       ()        the target's own token after the n accepted ones
so the whole rule sits inside the round's single evaluated graph.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Tuple

import mlx.core as mx

AcceptanceRule = Callable[[mx.array, mx.array, mx.array], Tuple[mx.array, mx.array]]


def _accepted_prefix(accepted: mx.array) -> mx.array:
    """Number of leading True values of a (k,) bool array."""
    return mx.cumprod(accepted.astype(mx.int32)).sum()


def greedy_accept(draft_tokens, draft_probs, target_logprobs):
    """temp == 0: keep drafts while they equal the target's argmax."""
    target_tokens = mx.argmax(target_logprobs, axis=-1).astype(mx.uint32)  # (k+1,)
    k = draft_tokens.shape[0]
    num_accepted = _accepted_prefix(draft_tokens == target_tokens[:k])
    return num_accepted, target_tokens[num_accepted]


def _rejection_sample(draft_tokens, draft_probs, target_logprobs, residual: bool, key=None,
                      chances: bool = False):
    """(n accepted, next token), and with `chances` each draft's chance of being kept from
    the same p (see acceptance_chances)."""
    k = draft_tokens.shape[0]
    u_key, token_key = mx.random.split(key) if key is not None else (None, None)
    p = mx.exp(target_logprobs)  # (k+1, V)
    rows = mx.arange(k)
    p_x = p[rows, draft_tokens]  # (k,)
    q_x = draft_probs[rows, draft_tokens]  # (k,)
    # Accept x_i with probability min(1, p(x_i) / q(x_i)).
    u = mx.random.uniform(shape=(k,), key=u_key)
    num_accepted = _accepted_prefix(u * q_x < p_x)
    # On rejection at n sample from normalise(max(0, p_n - q_n)); if all k
    # passed, q_k := 0 makes the same line draw the bonus token from p_k.
    q = mx.concatenate([draft_probs, mx.zeros((1, p.shape[-1]), p.dtype)])  # (k+1, V)
    p_n, q_n = p[num_accepted], q[num_accepted]  # (V,)
    leftover = mx.maximum(p_n - q_n, 0.0) if residual else p_n
    # p == q leaves no mass (and then rejection had probability 0): fall back to p.
    leftover = mx.where(leftover.sum() > 0, leftover, p_n)
    next_token = mx.random.categorical(mx.log(leftover), key=token_key).astype(mx.uint32)
    if chances:
        return num_accepted, next_token, _overlap(p[:k], draft_probs)
    return num_accepted, next_token


def _overlap(p, q):
    return mx.minimum(p, q).sum(axis=-1)


def acceptance_chances(draft_tokens, draft_probs, target_logprobs) -> mx.array:
    """(k,) the chance the residual rule keeps each draft, given the drafts before it:
    sum_x min(p_i(x), q_i(x)). The coin flip that decides a round averaged out (a
    Rao-Blackwell estimate): what a policy learns the source's acceptance from at T > 0, where
    one round's kept count is mostly the flips' noise."""
    return _overlap(mx.exp(target_logprobs[:draft_tokens.shape[0]]), draft_probs)


def keyed_rule(residual: bool = True) -> "KeyedRule":
    """The residual rule drawing from a random key of its own, passed as a fourth argument:
    a batch row's draws then do not depend on the other rows. `residual=False` gives the
    broken rule below (the statistical tests' negative control)."""
    return KeyedRule(residual)


class KeyedRule:
    """keyed_rule's rule: `rule(drafts, q, target_logprobs, key)` -> (n, next token), and
    `rule.with_chances(...)` -> (n, next token, acceptance_chances from the same p). Both
    compiled, as speculative_accept is: uncompiled, a row's rule and its chances cost 1.6x the
    loop's on a CPU at vocabularies of 4k-262k (docs/benchmarks.md, "A sampled row's rule and
    draws")."""

    def __init__(self, residual: bool = True):
        def rule(draft_tokens, draft_probs, target_logprobs, key):
            return _rejection_sample(draft_tokens, draft_probs, target_logprobs, residual, key)

        def with_chances(draft_tokens, draft_probs, target_logprobs, key):
            return _rejection_sample(draft_tokens, draft_probs, target_logprobs, residual, key,
                                     chances=True)

        self._rule, self.with_chances = mx.compile(rule), mx.compile(with_chances)

    def __call__(self, draft_tokens, draft_probs, target_logprobs, key):
        return self._rule(draft_tokens, draft_probs, target_logprobs, key)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def speculative_accept(draft_tokens, draft_probs, target_logprobs):
    """temp > 0: exact speculative sampling; output tokens are distributed as p."""
    return _rejection_sample(draft_tokens, draft_probs, target_logprobs, residual=True)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def speculative_accept_with_chances(draft_tokens, draft_probs, target_logprobs):
    """speculative_accept (the same draws), and acceptance_chances from its own p: (n, next
    token, chances (k,)). What the loop runs at T > 0: p's exponential is taken once."""
    return _rejection_sample(draft_tokens, draft_probs, target_logprobs, residual=True,
                             chances=True)


def resample_from_target_accept(draft_tokens, draft_probs, target_logprobs):
    """A classic BROKEN rule, kept as the statistical test's negative control.

    It resamples a rejected position from p instead of the residual p - q,
    which over-weights tokens the draft already offered. Never use it.
    """
    return _rejection_sample(draft_tokens, draft_probs, target_logprobs, residual=False)


def token_match_accept(draft_tokens, draft_probs, target_logprobs):
    """mlx-lm's rule at temp > 0: sample from p at each position, accept on equality.

    Exact, but accepts with probability sum_x p(x) q(x) instead of
    sum_x min(p(x), q(x)). Kept for the benchmark's comparison.
    """
    target_tokens = mx.random.categorical(target_logprobs, axis=-1).astype(mx.uint32)
    k = draft_tokens.shape[0]
    num_accepted = _accepted_prefix(draft_tokens == target_tokens[:k])
    return num_accepted, target_tokens[num_accepted]


def sampler_match(sampler) -> AcceptanceRule:
    """Any sampler (one mlx-spec cannot read): draw the target's token at every verified
    position with it, keep drafts while they equal those draws.

    Exact for any sampler: the token emitted at each position is the sampler's
    own draw from the target's log-probabilities given the tokens before it
    (mlx-lm's rule at temp > 0, with the caller's sampler)."""
    def rule(draft_tokens, draft_probs, target_logprobs):
        rows = [sampler(target_logprobs[i:i + 1]).reshape(-1) for i in range(target_logprobs.shape[0])]
        target_tokens = mx.concatenate(rows).astype(mx.uint32)  # (k+1,)
        k = draft_tokens.shape[0]
        num_accepted = _accepted_prefix(draft_tokens == target_tokens[:k])
        return num_accepted, target_tokens[num_accepted]
    rule.sampler = sampler  # (judge.verdict_parts: with no drafts the token is its draw too)
    return rule


def rule_for(sampling) -> AcceptanceRule:
    """The rule for a SamplingConfig: greedy, the residual rule, or the sampler's own."""
    if sampling.sampler is not None:
        return sampler_match(sampling.sampler)
    return greedy_accept if sampling.greedy else speculative_accept


def rule_name(sampling) -> str:
    """What the stats call the rule `rule_for(sampling)` gives."""
    if sampling.sampler is not None:
        return "sampler match"
    return "greedy" if sampling.greedy else "residual"
