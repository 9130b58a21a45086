"""Token trees in a batch: each row verifies a tree of its own in the round's one target pass.

With `tree=(depth, width)` the draft model's rows propose trees of the shape
one sequence gets from it (drafters/tree.py): its k drafts are the spine and
beside each spine node `width - 1` sibling leaves from the same q (T = 0: the
next-best tokens; T > 0: i.i.d. draws from q with the row's own key, with
replacement). Rows whose drafts come from prompt lookup or suffix drafting
keep their chains (a chain is a tree too), as do rows with no drafts.

The verify input is (B, N): each row's last token, its nodes, then filler
(children of the root that the row's own tree does not have, so never
accepted). During the pass (tree_verify.tree_forward) every attention layer's
mask is the row's tree mask: a node sees the row's context (past its left
padding; within the model's window where it asks for one) and its ancestors;
queries and keys are rotated at offset + depth, each row from its own offset
(the B N nodes go through RoPE's batch axis, one offset each, as the
single-sequence pass does). So each node's keys and values are those of its
path decoded alone. Each row is then judged alone (tree_acceptance: the
longest greedy path, or recursive rejection with the row's key), all rows'
outcomes come back in one transfer, and `keep_paths` gathers each row's
accepted path to the front of its N entries before the per-row trim
(kv.BatchCache.keep). Targets with recurrent layers keep chains.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..attention import round_attention
from ..sampling import logprobs_from_logits
from ..tree import ancestor_mask, depths, spine_and_siblings
from ..tree_acceptance import greedy_walk, tree_outcomes, walk
from ..tree_verify import tree_forward
from .kv import BatchCache
from .rows import Row
from .verify import RowProposal, Verdict


def draft_trees(rows: Sequence[Row], wants: Sequence[int], tokens: mx.array,
                probs: Sequence[Optional[mx.array]], logits: mx.array,
                width: int) -> List[Optional[RowProposal]]:
    """Each drafting row's tree from the draft model's proposal: drafts (B, K), q per sampled
    row (wants[i], V), the per-step logits (B, K, V_d); None for a row that drafts nothing."""
    out: List[Optional[RowProposal]] = []
    for i, (row, n) in enumerate(zip(rows, wants)):
        if not n:
            out.append(None)
            continue
        spine = tokens[i, :n].astype(mx.uint32)
        q = None if probs[i] is None else probs[i][:n]  # (n, V)
        if q is None:  # T = 0: the next-best tokens after the spine's own
            siblings = mx.argsort(-logits[i, :n], axis=-1)[:, 1:width]
        else:  # T > 0: i.i.d. draws from the spine's q, the row's own randomness
            siblings = mx.random.categorical(mx.log(q), axis=-1, num_samples=width - 1,
                                             key=row.next_key())
        nodes = mx.concatenate([spine[:, None], siblings.astype(mx.uint32)], axis=1)  # (n, w)
        out.append(RowProposal(nodes.reshape(-1), None if q is None else mx.repeat(q, width, axis=0),
                               "draft", parents=spine_and_siblings(n, width),
                               spine=tuple(1 + j * width for j in range(n))))
    return out


def _parents(proposal: Optional[RowProposal]) -> Tuple[int, ...]:
    """A row's tree: its proposal's, a chain's, or the root alone."""
    if proposal is None:
        return (-1,)
    if proposal.parents is not None:
        return tuple(proposal.parents)
    return tuple(range(-1, proposal.tokens.shape[0]))


def verify_trees(target: BatchCache, rows: Sequence[Row],
                 proposals: Sequence[Optional[RowProposal]],
                 residual: bool = True) -> Tuple[List[Verdict], int]:
    """(each row's verdict, the N positions fed) of one pass over every row's tree.
    `residual=False`: the naive rule (the statistical tests' negative control)."""
    trees = [_parents(p) for p in proposals]
    n = max(len(t) for t in trees)
    padded = [t + (0,) * (n - len(t)) for t in trees]  # filler: leaves under the root
    ancestors = mx.array(np.stack([ancestor_mask(t) for t in padded]))  # (B, N, N)
    steps = mx.array(ancestors.sum(-1) - 1, mx.int32)  # (B, N) each node's depth
    x = []
    for row, proposal, tree in zip(rows, proposals, trees):
        parts = [mx.array(row.history[-1:], mx.uint32)]
        if proposal is not None:
            parts.append(proposal.tokens.astype(mx.uint32))
        if n - len(tree):
            parts.append(mx.zeros((n - len(tree),), mx.uint32))
        x.append(mx.concatenate(parts))
    x = mx.stack(x)  # (B, N)
    with round_attention(), tree_forward(target.attention, steps, lambda layer, window: tree_mask(
            layer, ancestors, steps, window)[:, None]):  # (B, 1, N, K)
        target_logits = target.forward(x)  # (B, N, V)
    parts = []
    for i, (row, proposal, tree) in enumerate(zip(rows, proposals, trees)):
        m = len(tree)
        if row.greedy:  # the target's argmax at each node
            parts.append(mx.argmax(target_logits[i, :m], axis=-1).astype(mx.uint32))
        else:
            logprobs = logprobs_from_logits(target_logits[i, :m], row.request.sampling)
            slot, token = tree_outcomes(tree, x[i, 1:m], proposal.probs if m > 1 else
                                        mx.zeros((0, logprobs.shape[-1])), logprobs,
                                        residual=residual, key=row.next_key())
            parts += [slot.astype(mx.uint32), token]
    parts.append(x[:, 1:].reshape(-1))
    values = mx.concatenate(parts).tolist()  # the only sync of the round
    drafted_all, at, verdicts = values[-(n - 1) * len(rows):] if n > 1 else [], 0, []
    for i, (row, tree) in enumerate(zip(rows, trees)):
        m = len(tree)
        drafted = drafted_all[i * (n - 1):i * (n - 1) + m - 1]
        if row.greedy:
            path, token = greedy_walk(tree, drafted, values[at:at + m])
            at += m
        else:
            path, token = walk(tree, values[at:at + m], values[at + m:at + 2 * m])
            at += 2 * m
        kept = [0] + path
        verdicts.append(Verdict([drafted[j - 1] for j in path], len(path), token,
                                target_logits[i][mx.array(kept)], rows=kept,
                                depth=int(max(depths(tree)))))
    return verdicts, n


def tree_mask(layer, ancestors: mx.array, steps: mx.array,
              window_size: Optional[int] = None) -> mx.array:
    """(B, N, K) bool over the K = entries + N keys a BatchKVCache returns: row b's node i
    sees a context key past the row's left padding (within the window of a query at its
    depth), and its own ancestors."""
    rows, n = steps.shape
    context = mx.arange(layer._idx)  # buffer indices: position + the row's left padding
    seen = mx.broadcast_to(context[None, None] >= layer.left_padding[:, None, None],
                           (rows, n, layer._idx))
    tree = ancestors
    if window_size is not None:
        query = layer._idx + steps  # (B, N), in the same buffer index space
        seen = seen & (query[:, :, None] - context[None, None] < window_size)
        tree = tree & (steps[:, :, None] - steps[:, None, :] < window_size)
    return mx.concatenate([seen, tree], axis=-1)


def keep_paths(target: BatchCache, fed: int, kept_rows: Sequence[Sequence[int]],
               kept: Sequence[int]) -> None:
    """After a tree pass of `fed` positions: row b keeps its first `kept[b]` nodes of
    `kept_rows[b]` (the root, then its accepted path), gathered to the front of its `fed`
    entries, the rest dropped (BatchCache.keep)."""
    if any(list(r) != list(range(len(r))) for r in kept_rows):
        order = [list(r) + [j for j in range(fed) if j not in set(r)] for r in kept_rows]
        index = mx.array(order)[:, None, :, None]  # (B, 1, N, 1)
        for layer in target.attention:
            start, end = layer._idx - fed, layer._idx
            for name in ("keys", "values"):
                a = getattr(layer, name)
                tail = a[..., start:end, :]
                a[..., start:end, :] = mx.take_along_axis(
                    tail, mx.broadcast_to(index, tail.shape), axis=2)
    target.keep(fed, kept)
