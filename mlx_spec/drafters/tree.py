"""Tree proposals: several candidates per position, from the sources that have them.

`TreeDrafter(base, depth, width)` wraps a drafter and proposes a token tree
(mlx_spec.tree) instead of a chain, verified by the loop's `tree_round`:

- a draft model (`DraftModelDrafter`): its chain is the spine, and beside each
  spine node `width - 1` sibling leaves drawn from the same q (the draft's
  distribution at the spine node's parent): at T = 0 its next-best tokens, at
  T > 0 i.i.d. samples from q (with replacement, as the spine token itself).
  depth * width nodes for the draft cost of one chain.
- a head drafting from the target's hidden states (`HeadChainDrafter`: an MTP
  head, an EAGLE-3 head): the same shape, its chained drafts the spine and the
  siblings from the q of each chained step; after a tree round the loop hands it
  the target's states at the root and the accepted nodes (each node's is its
  path's decoded alone), so it continues from the accepted path.
- a DFlash block drafter (`DFlashDrafter`): the same shape, its block's drafts
  the spine and each row's siblings from that row's own q (its rows are drawn
  independently of each other, so a sibling is as good a draw as the spine's).
- a DFlash2 drafter (`DFlash2Drafter`): the same shape, its selector's walk the
  spine; row i's siblings come from q_i, the selector's distribution over row
  i's candidates given the spine's draft at depth i - 1 (the spine token's own
  q): at T = 0 the next-best candidates by score (past the candidates, when
  the width exceeds the selector's top-k, tokens of score -inf: never wrong,
  seldom useful), at T > 0 i.i.d. draws from q_i with replacement, so a node's
  children are independent draws from one q, as tree_acceptance's rule needs.
  They are leaves: continuing a sibling would need the selector's scores given it.
- prompt lookup (`PromptLookupDrafter`): its own proposal is the first path, and
  up to `width - 1` other earlier occurrences of the last n-gram (latest first)
  whose continuations differ add theirs; shared prefixes merge (a trie), so
  siblings are distinct tokens, each a point mass (one-hot q).
- suffix drafting (`SuffixDrafter`): the continuations of the longest matched
  suffix's occurrences, grouped where they disagree (SuffixIndex.follow_paths):
  its own, the most frequent, first, then up to `width - 1` others, the largest
  group first; a trie of point masses, as prompt lookup's.

A proposal's `spine` is the path its base drafter proposed as a chain: the
base is committed with how far the accepted path followed it.

With `tree=None` (the default) the policy chooses the width of a draft model's
(or a head's) tree each round (`TreeDrafter.width`, set by the loop from
`policy.tree_width`): width 1 proposes the base's own chain, a wider one a
spine with siblings, where the policy's model predicts it pays (policy.py).
Prompt lookup and suffix drafting then propose chains: the policy's model of a
tree is the spine-and-siblings shape (w - 1 siblings beside every spine node), not a
text search's, whose branches stand only where earlier text disagreed.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..tree import from_paths, spine_and_siblings
from ..tree_verify import tree_capable
from .dflash import DFlashDrafter
from .dflash2 import DFlash2Drafter
from .draft_model import DraftModelDrafter
from .head_chain import HeadChainDrafter
from .prompt_lookup import PromptLookupDrafter, _continue
from .protocol import Proposal, point_masses
from .suffix import SuffixDrafter


MAX_CHOSEN_WIDTH = 3  # the widest tree the policy may choose (Macs measured best at 1-3)


def with_trees(drafters, tree, target, sampling, verifiable: bool = True) -> list:
    """`drafters` with the spine sources (`_spine_source`), prompt lookup and suffix drafting
    proposing trees of `tree`'s (depth, width), where the target's cache can verify one
    (tree_verify.tree_capable), the rule is the library's own (`verifiable`: no custom accept,
    logits processors or sharded target) and so is the sampler. None: a spine source's width
    is the policy's choice each round (up to MAX_CHOSEN_WIDTH; 1, its chain, unless the policy says a
    tree pays), the text searches propose chains; False keeps the drafters as they are."""
    if tree is False or not verifiable or sampling.sampler is not None \
            or not tree_capable(target):
        return list(drafters)
    if tree is None:
        return [TreeDrafter(d, None, MAX_CHOSEN_WIDTH, chosen=True)
                if _spine_source(d) else d for d in drafters]
    depth, width = tree
    return [TreeDrafter(d, depth, width) if _tree_source(d) else d for d in drafters]


def _tree_source(drafter) -> bool:
    return isinstance(drafter, (PromptLookupDrafter, SuffixDrafter)) or _spine_source(drafter)


def _spine_source(drafter) -> bool:
    """A drafter whose chain has a q at every step, so siblings can stand beside it: a draft
    model of the target's tokenizer, a head chaining its own outputs, a DFlash or DFlash2
    drafter (each row's q given the spine before it)."""
    return type(drafter) in (DraftModelDrafter, DFlashDrafter, DFlash2Drafter) \
        or isinstance(drafter, HeadChainDrafter)


class TreeDrafter:
    """A drafter proposing trees of at most `depth` levels (None: the policy's k) and `width`
    children a node. `chosen`: the width is the policy's, set before each round
    (`max_width`: the most it may be; 1 proposes the base's chain)."""

    def __init__(self, base, depth: Optional[int], width: int, chosen: bool = False):
        if (depth is not None and depth < 1) or width < 1:
            raise ValueError(f"a tree needs depth >= 1 and width >= 1, got {depth}x{width}.")
        self.base, self.depth = base, depth
        self.max_width = width if chosen else None
        self.width = 1 if chosen else width
        self.source = base.source
        self._proposal: Optional[Proposal] = None
        if isinstance(base, PromptLookupDrafter):
            self._tree = self._lookup_tree
        elif isinstance(base, SuffixDrafter):
            self._tree = self._suffix_tree
        elif _tree_source(base):
            base.keep_logprobs = True  # its per-step log q, for the siblings
            self._tree = self._draft_tree
        else:
            raise ValueError(f"the {base.source!r} drafter proposes chains only.")

    def __getattr__(self, name):  # prefill, can_propose, peek, settle...: the base's own
        return getattr(self.base, name)

    def propose(self, history: List[int], k: int):
        if self.max_width is not None:  # the policy's width: 1 is the base's own chain
            self.base.keep_logprobs = self.width > 1
            if self.width == 1:
                self._proposal = None
                return self.base.propose(history, k)
        self._proposal = self._tree(history, k if self.depth is None else min(k, self.depth))
        return self._proposal

    def commit(self, path) -> None:
        """`path`: the accepted nodes (a tree round) or a count (a chain round)."""
        if isinstance(path, int) or self._proposal is None:
            return self.base.commit(path)
        self.base.commit(self._proposal.along_spine(path))
        self._proposal = None

    def _draft_tree(self, history: List[int], k: int) -> Optional[Proposal]:
        chain = self.base.propose(history, k)
        if chain is None:
            return None
        depth = chain.num_tokens
        scores = self.base.kept_logprobs[:depth]  # (depth, V_d) per spine step, lazy
        tokens, probs = beside_the_spine(chain.tokens, scores, chain.probs, self.width)
        spine = tuple(1 + i * self.width for i in range(depth))
        return Proposal(tokens, probs, self.source, self,
                        parents=spine_and_siblings(depth, self.width), spine=spine)

    def _lookup_tree(self, history: List[int], k: int) -> Optional[Proposal]:
        first = self.base.lookup(history, k)
        if not first:
            return None
        return self._point_mass_tree([first] + _other_matches(
            self.base._text, self.base.ngram_sizes, len(first), self.width - 1, first))

    def _suffix_tree(self, history: List[int], k: int) -> Optional[Proposal]:
        token_paths = self.base.lookup_paths(history, k, self.width)
        return self._point_mass_tree(token_paths) if token_paths else None

    def _point_mass_tree(self, token_paths: List[List[int]]) -> Proposal:
        """The trie of `token_paths` (the first the base's own proposal: the spine), each
        node a point mass (one-hot q): siblings are distinct tokens."""
        parents, tokens = from_paths(token_paths)
        drafted = mx.array(tokens[1:], mx.uint32)  # (N-1,)
        probs = None if self.base.greedy else point_masses(drafted, self.base.target_vocab_size)
        spine = _path_nodes(parents, tokens, token_paths[0])
        return Proposal(drafted, probs, self.source, self, parents=tuple(parents), spine=spine)


def beside_the_spine(spine: mx.array, scores: mx.array, q: Optional[mx.array], width: int,
                     key: Optional[mx.array] = None) -> Tuple[mx.array, Optional[mx.array]]:
    """(nodes (n w,), their q (n w, V) or None) of `spine_and_siblings(n, width)`: each of the
    `spine`'s n tokens, then `width - 1` sibling leaves from the same step: at T = 0 (`q`
    None) the next-best tokens by that step's `scores` (n, V); at T > 0 i.i.d. draws from its q
    (n, V), with replacement (`key`: a batch row's own randomness). One sequence's trees
    (TreeDrafter) and a batch's rows' (batch/trees.py)."""
    spine = spine.astype(mx.uint32)[:, None]  # (n, 1)
    if width == 1:
        siblings = mx.zeros((spine.shape[0], 0), mx.uint32)
    elif q is None:  # the argmax is the spine's own
        siblings = mx.argsort(-scores, axis=-1)[:, 1:width]
    else:
        siblings = mx.random.categorical(mx.log(q), axis=-1, num_samples=width - 1, key=key)
    nodes = mx.concatenate([spine, siblings.astype(mx.uint32)], axis=1).reshape(-1)
    return nodes, None if q is None else mx.repeat(q, width, axis=0)


def _other_matches(text: List[int], ngram_sizes, length: int, count: int,
                   first: List[int]) -> List[List[int]]:
    """Up to `count` continuations of other earlier occurrences of the text's last n-gram
    (the longest n that has any, latest occurrence first), each unlike `first` and the others."""
    found: List[List[int]] = []
    for n in ngram_sizes:
        if len(text) <= n or count == 0:
            continue
        tail = text[-n:]
        for end in range(len(text) - 1, n - 1, -1):
            if text[end - n:end] == tail:
                path = _continue(text[end:end + length], length)
                if path and path != first and path not in found and not first[:len(path)] == path:
                    found.append(path)
                    if len(found) == count:
                        return found
        if found:
            return found
    return found


def _path_nodes(parents: Sequence[int], tokens: Sequence[int], path: Sequence[int]) -> Tuple[int, ...]:
    """The node ids of a token path from the root."""
    nodes, node = [], 0
    for token in path:
        node = next(i for i in range(len(parents)) if parents[i] == node and tokens[i] == token)
        nodes.append(node)
    return tuple(nodes)
