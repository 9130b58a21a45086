"""Token trees: a parent array and what falls out of it.

A tree of N nodes is `parents`, a tuple with parents[0] == -1 (the root: the last
history token, the one a verify pass starts from) and parents[i] < i for every
other node (a parent comes before its children, so node order is a valid
flattening). From it, as in Medusa / EAGLE:

- `ancestor_mask`: mask[i] = mask[parent[i]] | onehot(i), (N, N) bool: node i
  attends to the context and to the nodes set in row i;
- `depths`: mask.sum(1) - 1, the root at 0; node i's position is
  context_length + depth[i] (nodes at equal depth share a position);
- `paths`: the root-to-leaf paths; `children`: each node's children in order
  (the order acceptance tries them in);
- `from_paths`: a trie of token paths (shared prefixes merged), flattened in
  BFS order (`bfs_order`).

Everything here is host maths on small Python/NumPy values: a tree has a few
to a few dozen nodes and its shape is known before the verify pass.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np


def check_parents(parents: Sequence[int]) -> None:
    """ValueError unless `parents` is a tree flattened parent-first with node 0 the root."""
    if not parents or parents[0] != -1:
        raise ValueError("a tree's parent array starts with -1 (the root).")
    for i, parent in enumerate(parents[1:], 1):
        if not 0 <= parent < i:
            raise ValueError(f"node {i}'s parent {parent} must come before it (0 <= parent < {i}).")


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """(N, N) bool: mask[i, j] is True when j is i or one of its ancestors."""
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def depths(parents: Sequence[int]) -> np.ndarray:
    """(N,) int: the root at 0, each node one deeper than its parent."""
    return ancestor_mask(parents).sum(1) - 1


def children(parents: Sequence[int]) -> List[List[int]]:
    """Each node's children, in node order."""
    kids: List[List[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(i)
    return kids


def widest(parents: Sequence[int]) -> int:
    """The most children any node has (1 for a chain)."""
    return max(len(kids) for kids in children(parents))


def paths(parents: Sequence[int]) -> List[List[int]]:
    """Every root-to-leaf path as node ids, the root first, leaves in node order."""
    mask = ancestor_mask(parents)
    kids = children(parents)
    return [list(np.flatnonzero(mask[leaf])) for leaf in range(len(parents)) if not kids[leaf]]


def bfs_order(parents: Sequence[int]) -> List[int]:
    """Node ids by depth, then by node order: a flattening where parents come first."""
    d = depths(parents)
    return sorted(range(len(parents)), key=lambda i: (d[i], i))


def from_paths(token_paths: Sequence[Sequence[int]]) -> Tuple[Tuple[int, ...], List[int]]:
    """(parents, tokens) of the trie of `token_paths` under a root, in BFS order.

    tokens[0] is a placeholder (-1) for the root; a path that is a prefix of another, or
    the same as another, adds nothing. Children keep the order their paths came in.
    """
    parents, tokens, index = [-1], [-1], {}  # index: (parent node, token) -> node
    for path in token_paths:
        node = 0
        for token in path:
            key = (node, int(token))
            if key not in index:
                index[key] = len(parents)
                parents.append(node)
                tokens.append(int(token))
            node = index[key]
    order = bfs_order(parents)
    where = {old: new for new, old in enumerate(order)}
    return (tuple(-1 if parents[old] < 0 else where[parents[old]] for old in order),
            [tokens[old] for old in order])


def along(path: Sequence[int], spine: Sequence[int]) -> int:
    """How many of `path`'s first nodes are `spine`'s first ones (the base drafter's own
    drafts an accepted path kept)."""
    n = 0
    while n < len(path) and n < len(spine) and path[n] == spine[n]:
        n += 1
    return n


def spine_and_siblings(depth: int, width: int) -> Tuple[int, ...]:
    """The draft model's tree shape: a chain of `depth` nodes (the spine) and at each depth
    `width - 1` sibling leaves beside the spine node, flattened spine node first at each
    depth. depth * width nodes under the root: the draft pays for the spine only."""
    parents, spine = [-1], 0
    for _ in range(depth):
        node = len(parents)
        parents.extend([spine] * width)  # the spine child first, then its siblings
        spine = node
    return tuple(parents)
