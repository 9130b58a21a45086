"""Token trees in a batch: each row verifies a tree of its own in the round's one target pass.

With `tree=(depth, width)` the draft model's rows propose trees of the shape
one sequence gets from it (drafters/tree.py): its k drafts are the spine and
beside each spine node `width - 1` sibling leaves from the same q (T = 0: the
next-best tokens; T > 0: i.i.d. draws from q with the row's own key, with
replacement). Rows whose drafts come from prompt lookup, suffix drafting or a
draft of another tokenizer keep their chains (a chain is a tree too), as do
rows with logits processors (applied along a chain's positions) and rows with
no drafts; a chain row is judged as `verify` judges it, so its text does not
depend on its neighbours' trees.

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
outcomes come back in one transfer, and the cache's `keep_paths` gathers each row's
accepted path to the front of its N entries before the per-row trim
(kv.BatchCache.keep). Targets with recurrent layers keep chains. The tree pass's masks and
the kept paths are the cache's own (`tree_pass`, `keep_paths`): a row alone on its own
cache kinds (solo.py) verifies its tree as a call does (tree_verify.tree_attention).
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..attention import round_attention
from ..sampling import logprobs_from_logits
from ..drafters.protocol import Proposal
from ..drafters.tree import beside_the_spine
from ..tree import ancestor_mask, depths, spine_and_siblings
from ..tree_acceptance import read_tree, tree_parts, tree_size
from .kv import BatchCache
from .rows import Row
from .verify import ACCEPT, Verdict, chain_parts, read_chain, verify_input


def draft_trees(rows: Sequence[Row], wants: Sequence[int], tokens: mx.array,
                probs: Sequence[Optional[mx.array]], logits: mx.array,
                width: int, source: str) -> List[Optional[Proposal]]:
    """Each drafting row's proposal from the model drafter's (`source`: a draft model, an MTP
    or EAGLE-3 head, a DFlash drafter's block or a DFlash2 drafter's walk): drafts (B, K), q
    per sampled row (wants[i], V), the per-step logits (B, K, V_d) (a DFlash2 walk's: each
    row's selector scores given the spine's draft before it): a tree
    (drafters/tree.beside_the_spine, the row's own key), or a chain for a row that drafts
    chains only (RowRequest.chains_only); None for a row that drafts nothing."""
    out: List[Optional[Proposal]] = []
    for i, (row, n) in enumerate(zip(rows, wants)):
        q = None if not n or probs[i] is None else probs[i][:n]  # (n, V)
        if not n:
            out.append(None)
        elif row.request.chains_only:
            out.append(Proposal(tokens[i, :n], q, source))
        else:
            nodes, node_q = beside_the_spine(tokens[i, :n], logits[i, :n], q, width,
                                             None if q is None else row.next_key())
            out.append(Proposal(nodes, node_q, source, parents=spine_and_siblings(n, width),
                                   spine=tuple(1 + j * width for j in range(n))))
    return out


def _parents(proposal: Optional[Proposal]) -> Tuple[int, ...]:
    """A row's tree: its proposal's, a chain's, or the root alone."""
    if proposal is None:
        return (-1,)
    if proposal.parents is not None:
        return tuple(proposal.parents)
    return tuple(range(-1, proposal.tokens.shape[0]))


def verify_trees(target: BatchCache, rows: Sequence[Row],
                 proposals: Sequence[Optional[Proposal]],
                 accept=ACCEPT) -> Tuple[List[Verdict], int]:
    """(each row's verdict, the N positions fed) of one pass over every row's tree. A row
    with a chain (or nothing) is judged as `verify` judges it (verify.chain_parts: its
    processors, its rule, its key), so its text does not depend on its neighbours' trees."""
    trees = [_parents(p) for p in proposals]
    n = max(len(t) for t in trees)
    padded = [t + (0,) * (n - len(t)) for t in trees]  # filler: leaves under the root
    ancestors = mx.array(np.stack([ancestor_mask(t) for t in padded]))  # (B, N, N)
    steps = mx.array(ancestors.sum(-1) - 1, mx.int32)  # (B, N) each node's depth
    x = verify_input(rows, proposals, n)  # (B, N): filler leaves under each row's root
    with round_attention(), target.tree_pass(trees, ancestors, steps):
        target_logits = target.forward(x)  # (B, N, V)
    parts, row_logits = [], []
    for i, (row, proposal, tree) in enumerate(zip(rows, proposals, trees)):
        logits = target_logits[i, :len(tree)]
        if proposal is None or proposal.parents is None:
            part, logits = chain_parts(row, proposal, logits, accept)
        else:
            part = tree_parts(tree, proposal.tokens, proposal.probs, logits,
                              None if row.greedy else logprobs_from_logits(
                                  logits, row.request.sampling), row.greedy, row.next_key())
        parts.append(part)
        row_logits.append(logits)
    values = mx.concatenate(parts).tolist()  # the only sync of the round
    verdicts, at = [], 0
    for row, proposal, tree, logits in zip(rows, proposals, trees, row_logits):
        if proposal is None or proposal.parents is None:
            verdict, at = read_chain(row, len(tree) - 1, logits, values, at)
            verdicts.append(replace(verdict, nodes=list(range(verdict.accepted + 1))))
            continue
        size = tree_size(tree, row.greedy)
        path, token, drafted = read_tree(tree, values[at:at + size], row.greedy)
        at += size
        kept = [0] + path
        verdicts.append(Verdict([drafted[j - 1] for j in path], len(path), token,
                                logits[mx.array(kept)], nodes=kept, depth=int(max(depths(tree)))))
    return verdicts, n


def path_states(hidden: mx.array, kept_rows: Sequence[Sequence[int]]) -> mx.array:
    """The target's states (B, N, H) of a tree pass at each row's kept nodes (the root, then
    its accepted path), gathered to the front (B, L, H): what a head's pairs read."""
    longest = max(len(r) for r in kept_rows)
    index = mx.array([list(r) + [0] * (longest - len(r)) for r in kept_rows])[..., None]
    return mx.take_along_axis(hidden, index, axis=1)
