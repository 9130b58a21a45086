"""One batched round: the target verifies every row's drafts in one pass; each row is judged alone.

The verify input is (B, width + 1): each row's last token, its drafts, and
filler after a row's own drafts where another row drafted more (a row never
accepts past its own drafts, so filler is never kept). Each row is then
judged by its own rule on its own slice: greedy rows compare the target's
argmax with their drafts on the host, sampled rows run the residual rule
with their own random key (an `accept` rule of the loop's kind, with no key:
MLX's global random state), a row with an opaque sampler keeps drafts while
they equal the sampler's draws (acceptance.sampler_match). Everything the
host needs from every row comes back in one transfer: the round's only sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx

from ..acceptance import KeyedRule, greedy_accept, keyed_rule, sampler_match
from ..attention import round_attention
from ..drafters.protocol import Proposal
from ..judge import prefix_match, read_verdict, stop_cut, verdict_parts, verdict_size
from ..loop import processed
from ..sampling import logprobs_from_logits
from .kv import BatchCache
from .rows import Row


@dataclass
class Verdict:
    """One row's outcome: `accepted` drafts were kept, then the target's `token`."""

    drafted: List[int]
    accepted: int
    token: int
    logits: mx.array  # (n + 1, V) the target's, after the row's processors, lazy
    nodes: Optional[List[int]] = None  # a tree's: the nodes kept (the root, then the path)
    depth: Optional[int] = None  # ... and the tree's depth
    chances: Optional[List[float]] = None  # a sampled chain's, each draft's chance of being kept

    @property
    def num_drafted(self) -> int:
        """The chain's drafts, or the tree's depth (what the policy's chain accounting reads)."""
        return len(self.drafted) if self.depth is None else self.depth


ACCEPT = keyed_rule(residual=True)


def verify(target: BatchCache, rows: Sequence[Row], proposals: Sequence[Optional[Proposal]],
           accept=ACCEPT, chances: bool = False) -> List[Verdict]:
    """Each row's verdict (`chances`: a sampled row's carries each draft's chance of being
    kept under the residual rule, for a row alone's policy, as a call's round does)."""
    lengths = [0 if p is None else p.tokens.shape[0] for p in proposals]
    chances = chances and isinstance(accept, KeyedRule)  # (the keyed residual rule's own)
    x = verify_input(rows, proposals, max(lengths) + 1)  # (B, width + 1)
    with round_attention():
        target_logits = target.forward(x)  # (B, width + 1, V)
    if all(row.greedy and not row.request.logits_processors for row in rows):
        return _greedy_verdicts(rows, lengths, x, target_logits)
    summaries, row_logits = [], []
    for i, (row, proposal, n) in enumerate(zip(rows, proposals, lengths)):
        parts, logits = chain_parts(row, proposal, target_logits[i, :n + 1], accept,
                                    chances=chances)
        summaries.append(parts)
        row_logits.append(logits)
    values = mx.concatenate(summaries).tolist()  # the only sync of the round
    verdicts, at = [], 0
    for row, n, logits in zip(rows, lengths, row_logits):
        verdict, at = read_chain(row, n, logits, values, at, chances)
        verdicts.append(verdict)
    return verdicts


def verify_input(rows: Sequence[Row], proposals: Sequence[Optional[Proposal]],
                 n: int) -> mx.array:
    """(B, n) uint32: each row's last token, its proposal's tokens (a chain's drafts, a
    tree's nodes), then filler where another row has more (never accepted)."""
    if n == 1:  # no drafts (plain batched decoding): one transfer
        return mx.array([row.history[-1:] for row in rows], mx.uint32)
    x = []
    for row, proposal in zip(rows, proposals):
        parts = [mx.array(row.history[-1:], mx.uint32)]
        if proposal is not None:
            parts.append(proposal.tokens.astype(mx.uint32))
        filler = n - sum(p.shape[0] for p in parts)
        if filler:
            parts.append(mx.zeros((filler,), mx.uint32))
        x.append(mx.concatenate(parts) if len(parts) > 1 else parts[0])
    return mx.stack(x)


def chain_parts(row: Row, proposal: Optional[Proposal], logits: mx.array, accept=ACCEPT,
                unread: Optional[mx.array] = None, chances: bool = False):
    """(the row's verdict parts (judge.verdict_parts), its logits (n + 1, V) after its
    processors), lazy: a chain of n drafts (none: the target's own token) judged by the row's
    rule (the keyed rule with its own key; an opaque sampler's draws, sampler_match; a rule
    with no key from the global random state). `unread`: a queued plain step's input (1,),
    lazy, which the row's history does not hold yet (its processors see it)."""
    n = logits.shape[0] - 1
    drafts = proposal.tokens.astype(mx.uint32) if n else mx.zeros((0,), mx.uint32)
    if row.request.logits_processors:
        seen = mx.array(row.history, mx.uint32)
        if unread is not None:
            seen = mx.concatenate([seen, unread.astype(mx.uint32)])
        logits = processed(row.request.logits_processors, seen, drafts, logits)
    if row.greedy:
        return verdict_parts(greedy_accept, drafts, None, logits, None), logits
    logprobs = logprobs_from_logits(logits, row.request.sampling)
    if row.sampler is not None:  # its own draws at every position, kept while drafts equal them
        return verdict_parts(sampler_match(row.sampler), drafts, None, logits, logprobs), logits
    keyed = isinstance(accept, KeyedRule)  # (another rule draws from the global random state)
    return verdict_parts(accept, drafts, proposal.probs if n else None, logits, logprobs,
                         key=row.next_key() if keyed else None, chances=chances and keyed), logits


def read_chain(row: Row, n: int, logits: mx.array, values: list, at: int,
               chances: bool = False):
    """(the row's Verdict, where the next row's values start) from the round's host values."""
    chances = chances and not row.greedy and row.sampler is None and n > 0
    size = verdict_size(n, row.greedy, chances)
    accepted, token, drafted, kept = read_verdict(values[at:at + size], n, row.greedy, chances)
    return Verdict(drafted, accepted, token, logits, chances=kept), at + size


def _greedy_verdicts(rows, lengths, x, target_logits) -> List[Verdict]:
    """Every row greedy with no processors: one argmax over the batch, one transfer."""
    width = x.shape[1] - 1
    judged = mx.argmax(target_logits, axis=-1).astype(mx.uint32)  # (B, width + 1)
    values = mx.concatenate([judged, x[:, 1:]], axis=1).tolist()  # the only sync of the round
    verdicts = []
    for i, (row_values, n) in enumerate(zip(values, lengths)):
        judged_row, drafted = row_values[:width + 1], row_values[width + 1:width + 1 + n]
        accepted = prefix_match(drafted, judged_row)
        verdicts.append(Verdict(drafted, accepted, judged_row[accepted], target_logits[i, :n + 1]))
    return verdicts


def spine_kept(proposal: Proposal, verdict: Verdict) -> int:
    """How many of the draft model's own drafts the verdict kept (a tree: the accepted path's
    first nodes that are its spine's)."""
    return verdict.accepted if verdict.nodes is None else proposal.along_spine(verdict.nodes[1:])


def emitted_tokens(row: Row, verdict: Verdict):
    """(tokens the row emits, finish reason or None): cut at an accepted stop token and at
    the row's budget."""
    tokens = (verdict.drafted[:verdict.accepted] + [verdict.token])[:row.room]
    kept = stop_cut(tokens, row.stop_tokens)
    if kept[-1] in row.stop_tokens:
        return kept, "stop"
    return kept, ("length" if len(kept) >= row.room else None)
