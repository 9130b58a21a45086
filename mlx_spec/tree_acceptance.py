"""Accept/reject over a token tree: SpecInfer's recursive rejection sampling.

Notation as in acceptance.py: p = target, q = draft. A tree's node i > 0 holds a
token x_i drawn from q_i (its row of `draft_probs`), given the path to its
parent; the children of a node are its candidates, tried in node order.

At each node u, with p the target's distribution there:
    for each child c in order:
        accept x_c with probability min(1, p(x_c) / q_c(x_c))       -> go to c
        on rejection  p <- normalise(max(0, p - q_c))               (the residual)
    every child rejected: emit a token drawn from p (the last residual)
A leaf that is reached emits a token drawn from its own p (the bonus token).

This keeps the target's distribution exactly when the children of a node were
drawn independently of one another, each from its own q_c (SpecInfer, Miao et
al. 2024, Theorem 4.2): i.i.d. samples from the draft's q at u (with
replacement: a duplicate is a candidate of its own, rejected with certainty
after the first copy's rejection since then p(x) = 0), or deterministic
candidates with a one-hot q (prompt lookup: p(x) itself is the acceptance
chance, and a rejection removes x from p). See docs/exactness.md.

Every node's outcome is computed at once on the device, each from randomness
of its own (`tree_outcomes`); the host walks from the root (`walk`) after the
round's one sync. A node the walk never reaches was never looked at, so the
outcomes of the nodes on the walk are those of the sequential procedure.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .tree import children


def child_table(parents: Sequence[int]) -> np.ndarray:
    """(N, W) int: each node's children in order, -1 past its last (W: the widest node)."""
    kids = children(parents)
    width = max(1, max(len(k) for k in kids))
    table = np.full((len(parents), width), -1, np.int32)
    for node, k in enumerate(kids):
        table[node, :len(k)] = k
    return table


def tree_outcomes(parents: Sequence[int], draft_tokens, draft_probs, target_logprobs,
                  residual: bool = True, key=None) -> Tuple[mx.array, mx.array]:
    """(accepted child slot (N,), token (N,)), lazy: at every node the slot of the child
    the rule accepts (its width W when none is) and the token drawn from the last residual
    (only read when no child is accepted, or at a leaf).

    draft_tokens (N-1,) and draft_probs (N-1, V) are nodes 1..N-1; target_logprobs (N, V).
    `residual=False` is the NAIVE rule (the statistical tests' negative control): each
    child is accepted with min(1, p(x)/q(x)) against the node's unchanged p, and a node
    whose children are all rejected draws from max(0, p - q) of its last child only.
    `key`: the draws' own random key (a batch row's), else MLX's global generator.
    """
    uniform_key, token_key = mx.random.split(key) if key is not None else (None, None)
    table = child_table(parents)  # (N, W)
    n, width = table.shape
    p = mx.exp(target_logprobs)  # (N, V)
    # Node i's token and q at index i (the root's row is never used: it is no one's child).
    tokens = mx.concatenate([mx.zeros((1,), mx.uint32), draft_tokens.astype(mx.uint32)])
    q = mx.concatenate([mx.zeros((1, p.shape[-1]), p.dtype), draft_probs.astype(p.dtype)])
    rows = mx.arange(n)
    slot = mx.full((n,), width, mx.int32)  # no child accepted yet
    u = mx.random.uniform(shape=(n, width), key=uniform_key)
    draw = p  # what a node whose children are all rejected draws from
    for j in range(width):
        valid = mx.array(table[:, j] >= 0)  # (N,)
        child = mx.array(np.maximum(table[:, j], 0))
        x = tokens[child]  # (N,)
        q_c = q[child]  # (N, V)
        open_ = valid & (slot == width)  # nodes still trying children
        accept = open_ & (u[:, j] * q_c[rows, x] < p[rows, x])
        slot = mx.where(accept, j, slot)
        left = _residual(p, q_c)
        if residual:
            p = draw = mx.where((open_ & ~accept)[:, None], left, p)
        else:  # p stays; the draw is the last child's own residual
            draw = mx.where(valid[:, None], left, draw)
    token = mx.random.categorical(mx.log(draw), axis=-1, key=token_key).astype(mx.uint32)  # (N,)
    return slot, token


def _residual(p, q):
    """normalise(max(0, p - q)) per row; p itself where that leaves no mass (p == q: a
    rejection then had probability 0)."""
    left = mx.maximum(p - q, 0.0)
    total = left.sum(-1, keepdims=True)
    return mx.where(total > 0, left / mx.maximum(total, 1e-30), p)


def greedy_targets(target_logits) -> mx.array:
    """(N,) the target's argmax at every node (T = 0)."""
    return mx.argmax(target_logits, axis=-1).astype(mx.uint32)


def tree_parts(parents: Sequence[int], drafts: mx.array, probs, target_logits, target_logprobs,
               greedy: bool, key=None) -> mx.array:
    """(size,) uint32, lazy: one tree's verdict as the host reads it (`read_tree`), for one
    sequence (loop.py) and each row of a batch (batch/trees.py): greedy, the target's argmax
    at every node; else each node's accepted slot and token (`tree_outcomes`, with `key`);
    then the drafts (nodes 1..N-1)."""
    drafts = drafts.astype(mx.uint32)
    if greedy:
        return mx.concatenate([greedy_targets(target_logits), drafts])
    slot, token = tree_outcomes(parents, drafts, probs, target_logprobs, key=key)
    return mx.concatenate([slot.astype(mx.uint32), token, drafts])


def tree_size(parents: Sequence[int], greedy: bool) -> int:
    """How many values `tree_parts` ships for this tree."""
    return (2 if greedy else 3) * len(parents) - 1


def read_tree(parents: Sequence[int], values: Sequence[int],
              greedy: bool) -> Tuple[List[int], int, List[int]]:
    """(accepted nodes, the token after them, every drafted token) from `tree_parts`' values."""
    n = len(parents)
    if greedy:
        drafted = list(values[n:2 * n - 1])
        path, token = greedy_walk(parents, drafted, values[:n])
    else:
        drafted = list(values[2 * n:3 * n - 1])
        path, token = walk(parents, values[:n], values[n:2 * n])
    return path, token, drafted


def walk(parents: Sequence[int], slot: Sequence[int], token: Sequence[int]) -> Tuple[List[int], int]:
    """(accepted nodes from the root's first child on, the token after them) from the
    per-node outcomes (host values)."""
    kids = children(parents)
    node, path = 0, []
    while slot[node] < len(kids[node]):
        node = kids[node][slot[node]]
        path.append(node)
    return path, int(token[node])


def greedy_walk(parents: Sequence[int], drafted: Sequence[int],
                target_tokens: Sequence[int]) -> Tuple[List[int], int]:
    """T = 0: follow the child equal to the target's argmax while there is one (the longest
    path equal to the target's own greedy walk); (its nodes, the target's token after)."""
    kids = children(parents)
    node, path = 0, []
    while True:
        nxt = next((c for c in kids[node] if drafted[c - 1] == target_tokens[node]), None)
        if nxt is None:
            return path, int(target_tokens[node])
        node = nxt
        path.append(node)
