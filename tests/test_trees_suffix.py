"""Token trees from suffix drafting (issue 66): the index's alternatives, the tree drafter
over a suffix drafter, greedy parity and exactness at T = 1.

- `SuffixIndex.follow_paths` on hand-made sequences: distinct continuations, the most
  frequent first, branching where the occurrences disagree, capped by width and k; on
  random ones, its first path is brute-force `follow`'s and the rest keep the rules (no
  path a prefix of another, supports non-increasing, no qualifying branch left out);
- `TreeDrafter` over a `SuffixDrafter`: the suffix's chain is the spine, siblings distinct
  point masses; `with_trees` wraps suffix drafting for a fixed shape, not for the policy's;
- greedy parity over 120 tokens with suffix trees of two shapes on a plain and a quantized
  target, the index holding earlier requests' text whose continuations conflict (the
  majority often wrong), so that tree rounds keep siblings; suffix trees in front of prompt
  lookup and a draft model, and an index shared across calls;
- chi-square at T = 1 on the first two tokens (a width-3 root of the target's likeliest
  tokens) and on tokens 3-4 after a first round that rejected (width 2-3 trees of them); the
  naive rule (each candidate accepted on its own) fails both.
"""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.drafters.suffix import SuffixDrafter
from mlx_spec.drafters.suffix_index import SuffixIndex
from mlx_spec.drafters.tree import TreeDrafter, with_trees
from mlx_spec.exactness import chi_square, exact_distribution
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from mlx_spec.tree import children
from test_exactness import exact_third_and_fourth
from test_suffix import brute_follow
from test_trees import PROMPT, SHAPE, _decode, _quantized
from tiny import make_llama, perturbed

ALPHA = 1e-3

# -- the index's alternatives --------------------------------------------------------------


def _index(*sequences):
    index = SuffixIndex()
    for sequence in sequences:
        index.add(sequence)
    return index


def _paths(index, context, k, width, min_share=0.1):
    return index.follow_paths(index.longest(context), context, k, width, min_share)


def test_the_alternatives_are_distinct_ordered_by_frequency_and_branch_where_they_disagree():
    context = [0, 1, 2, 3]
    index = _index(*[[1, 2, 3, 4, 5, 6]] * 3, *[[1, 2, 3, 4, 5, 7]] * 2, [1, 2, 3, 8, 9])
    # 4 5 by five occurrences, then 6 by three and 7 by two; 8 9 by one
    assert _paths(index, context, 3, 3) == [[4, 5, 6], [4, 5, 7], [8, 9]]
    assert _paths(index, context, 3, 2) == [[4, 5, 6], [4, 5, 7]]  # capped by width
    assert _paths(index, context, 3, 1) == [[4, 5, 6]] == [index.follow(index.longest(context),
                                                                        context, 3)]
    assert _paths(index, context, 2, 3) == [[4, 5], [8, 9]]  # by k: no branch past it
    assert _paths(index, context, 3, 3, min_share=0.3) == [[4, 5, 6], [4, 5, 7]]  # 8: 1 of 6
    assert _paths(index, [0, 9], 3, 3) == []  # no match: nothing
    tie = _index([1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7])
    assert _paths(tie, context, 2, 3) == [[7], [6], [5]]  # a tie goes to the latest


def test_a_live_context_s_own_loop_is_one_of_the_alternatives():
    context = [1, 2, 1, 2]  # "2" was followed by "1 2": its period continues past its end
    index = _index([1, 2, 7, 7], [1, 2, 7, 7])
    index.add(context, live=True)
    assert _paths(index, context, 4, 2) == [[7, 7], [1, 2, 1, 2]]


def _supports(sequences, found, path, depth):
    """How many occurrences continue with path[:depth + 1] (none runs past its sequence)."""
    return sum(sequences[i][e:e + depth + 1] == path[:depth + 1] for i, e in found)


@pytest.mark.parametrize("seed", range(25))
def test_the_alternatives_keep_the_rules_on_random_text(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 4, 6])
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    index = _index(*sequences)
    context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
    k, width, min_share = rng.randrange(1, 7), rng.randrange(1, 5), rng.choice([0.0, 0.1, 0.3])
    match = index.longest(context)
    paths = index.follow_paths(match, context, k, width, min_share)
    found = [(p >> 32, p & 0xFFFFFFFF) for p in match.positions]
    first = brute_follow(sequences, found, context, None, k, min_share) if match.length else []
    assert paths[:1] == ([first] if first else [])
    assert len(paths) <= width and all(0 < len(p) <= k for p in paths)
    for i, p in enumerate(paths):  # none a prefix of another (distinct tries' leaves)
        assert not any(q[:len(p)] == p for j, q in enumerate(paths) if j != i)
    # Each later path leaves the earlier ones at a token at least min_share continue with,
    # and those supports never grow: the largest group first.
    supports = [len(found)]
    for i, p in enumerate(paths[1:], 1):
        depth = max(next((d for d in range(len(p)) if q[d:d + 1] != p[d:d + 1]), len(p))
                    for q in paths[:i])
        supports.append(_supports(sequences, found, p, depth))
        assert supports[-1] >= max(min_share * len(found), 1)
    assert supports == sorted(supports, reverse=True)
    if len(paths) < width:  # nothing left out: every qualifying branch off a path is a path
        for p in paths:
            for d in range(len(p)):
                agreeing = [(i, e) for i, e in found if sequences[i][e:e + d] == p[:d]]
                if len(agreeing) == 1 and min_share * len(found) <= 1:
                    break  # one occurrence left: copied, no branch
                nexts = [sequences[i][e + d:e + d + 1] for i, e in agreeing]
                for token in {t[0] for t in nexts if t}:
                    n = nexts.count([token])
                    if n >= min_share * len(found) and token != p[d]:
                        assert any(q[:d + 1] == p[:d] + [token] for q in paths), (p, d, token)


# -- the tree drafter over a suffix drafter ---------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False])
def test_a_suffix_tree_has_the_suffix_chain_as_its_spine_and_point_masses(greedy):
    index = _index(*[[1, 2, 3, 4, 5, 6]] * 3, *[[1, 2, 3, 4, 5, 7]] * 2, [1, 2, 3, 8, 9])
    history = [0, 1, 2, 3]
    chain = SuffixDrafter(index, 16, greedy).lookup(history, 3)
    drafter = TreeDrafter(SuffixDrafter(index, 16, greedy), 3, 3)
    proposal = drafter.propose(history, 8)  # depth 3: at most 3 levels
    tokens = proposal.tokens.tolist()
    assert [tokens[n - 1] for n in proposal.spine] == chain == [4, 5, 6]
    assert proposal.parents == (-1, 0, 0, 1, 2, 3, 3) and proposal.width == 2
    assert tokens == [4, 8, 5, 9, 6, 7]  # the trie in BFS order
    for kids in children(proposal.parents):  # siblings: distinct tokens
        assert len({tokens[c - 1] for c in kids}) == len(kids)
    if greedy:
        assert proposal.probs is None
    else:  # one-hot q on each node's own token
        assert mx.array_equal(proposal.probs, mx.eye(16)[proposal.tokens]).item()
    drafter.commit([1, 3])  # a tree round: how far the path followed the spine
    assert drafter.propose([0, 9, 9], 3) is None  # no match: no tree


def test_with_trees_wraps_suffix_drafting_for_a_shape_and_not_for_the_policy_s(models):
    from mlx_spec.cache import ModelCache, make_cache

    target = ModelCache(models["plain"], make_cache(models["plain"]))
    drafter = SuffixDrafter(SuffixIndex(), 64, True)
    wrapped, = with_trees([drafter], (4, 2), target, SamplingConfig())
    assert isinstance(wrapped, TreeDrafter) and wrapped.base is drafter and wrapped.width == 2
    assert with_trees([drafter], None, target, SamplingConfig()) == [drafter]  # chains
    assert with_trees([drafter], False, target, SamplingConfig()) == [drafter]


# -- greedy parity ---------------------------------------------------------------------------

TOKENS = 120  # test_trees._decode's


@pytest.fixture(scope="module")
def models():
    return {"plain": make_llama(seed=0, **SHAPE),
            "quantized": _quantized(make_llama(seed=0, **SHAPE))}


@pytest.fixture(scope="module")
def references(models):
    return {kind: _decode(model, None, prompt_lookup=False)[0] for kind, model in models.items()}


def conflicting_index(text, start, vocab=64, seed=0, left=6):
    """Earlier requests' text: at every position of `text` from `start` on, its `left` tokens
    before, then continuations that conflict: the right one outvoted (kept only as a
    sibling), the right one leading and a wrong one beside it, or the right one in third
    place (only a width-3 tree holds it)."""
    rng = random.Random(seed)
    index = SuffixIndex()
    for i in range(start, len(text)):
        right = text[i:i + 8]
        wrong = [(t + 1 + j) % vocab for j, t in enumerate(right)]
        other = [(t + 2 + j) % vocab for j, t in enumerate(right)]
        pattern = rng.randrange(4)
        if pattern == 0:  # outvoted at the first token
            endings = [wrong, wrong, right[:1]]
        elif pattern == 1:  # outvoted at the third
            endings = [right[:2] + wrong[2:]] * 2 + [right[:3]]
        elif pattern == 2:  # third: the latest of two single occurrences wins the tie
            endings = [wrong, wrong, right[:2], other]
        else:  # leading
            endings = [right[:4], right[:4], wrong]
        for ending in endings:
            index.add(text[i - left:i] + ending)
    return index


@pytest.mark.parametrize("target_kind", ["plain", "quantized"])
@pytest.mark.parametrize("shape", [(4, 2), (6, 3)])
def test_greedy_suffix_trees_keep_the_target_s_text(models, references, target_kind, shape):
    target, reference = models[target_kind], references[target_kind]
    index = conflicting_index(PROMPT + reference, len(PROMPT))
    out, rounds = _decode(target, None, prompt_lookup=False, suffix=index,
                          num_draft_tokens=shape[0], tree=shape)
    assert len(out) == TOKENS and out == reference
    trees = [r for r in rounds if r.tree_nodes]
    assert len(trees) > len(rounds) // 2 and all(r.source == "suffix" for r in trees)
    assert all(r.num_drafted <= shape[0] and r.tree_width <= shape[1] for r in trees)
    assert any(r.tree_width == shape[1] for r in trees)
    siblings = [r for r in trees if r.num_accepted > r.spine_kept]  # a sibling was kept
    assert len(siblings) >= 5, [(r.tree_nodes, r.num_accepted, r.spine_kept) for r in trees]


def test_suffix_trees_in_front_of_lookup_and_a_draft_model_keep_parity(models, references):
    target, reference = models["plain"], references["plain"]
    draft = perturbed(target, noise=0.1, seed=1)
    for draft_model, lookup in [(None, True), (draft, False), (draft, True)]:
        index = conflicting_index(PROMPT + reference, len(PROMPT))
        out, rounds = _decode(target, draft_model, prompt_lookup=lookup, suffix=index,
                              num_draft_tokens=4, tree=(4, 2))
        assert out == reference, (draft_model is not None, lookup)
        assert any(r.source == "suffix" and r.tree_nodes for r in rounds)


def test_calls_sharing_an_index_draft_trees_from_each_other(models, references):
    target, reference = models["plain"], references["plain"]
    index = SuffixIndex()
    first, _ = _decode(target, None, prompt_lookup=False, suffix=index, num_draft_tokens=4,
                       tree=(4, 3))
    second, rounds = _decode(target, None, prompt_lookup=False, suffix=index,
                             num_draft_tokens=4, tree=(4, 3))
    assert first == second == reference
    suffix = [r for r in rounds if r.source == "suffix"]
    assert all(r.tree_nodes for r in suffix)
    assert sum(r.num_accepted for r in suffix) >= TOKENS * 3 // 5  # the first call's text


# -- exactness at T = 1 -----------------------------------------------------------------------

SHORT_PROMPT = [3, 1, 4, 1, 3, 1, 5, 1]
FIRST_SAMPLES = 600


def _ranked(target, prompt, prefixes):
    """The target's tokens by probability, likeliest first, after prompt + each prefix."""
    logits = target(mx.array([prompt + list(p) for p in prefixes]))[:, -1]  # (P, V)
    return np.argsort(-np.array(logits.astype(mx.float32)), axis=-1)


@pytest.fixture(scope="module")
def first_tokens(models):
    """(exact (t1, t2) distribution, earlier text after SHORT_PROMPT): the target's three
    likeliest first tokens a > b > c by 4, 2 and 1 occurrences; after a, its likeliest
    token three times, its second once."""
    target = models["plain"]
    a, b, c = (int(t) for t in _ranked(target, SHORT_PROMPT, [()])[0, :3])
    after = _ranked(target, SHORT_PROMPT, [(a,), (b,), (c,)])
    endings = [[a, int(after[0, 0])]] * 3 + [[a, int(after[0, 1])]] \
        + [[b, int(after[1, 0])]] * 2 + [[c, int(after[2, 0])]]
    return exact_distribution(target, SHORT_PROMPT, SamplingConfig(temp=1.0)), endings


def _first_pairs(target, endings, shape, seed):
    """(t1, t2) counts of FIRST_SAMPLES calls at T = 1, each drafting suffix trees of `shape`
    from a fresh index of SHORT_PROMPT + each ending; the tree rounds and those that kept a
    sibling, and the widest tree."""
    mx.random.seed(seed)
    counts, trees, siblings, widest = {}, 0, 0, 0
    for _ in range(FIRST_SAMPLES):
        out = []
        index = _index(*[SHORT_PROMPT + ending for ending in endings])
        for round_ in speculative_generate_step(
                SHORT_PROMPT, target, None, max_tokens=2, num_draft_tokens=shape[0],
                sampling=SamplingConfig(temp=1.0), prompt_lookup=False, suffix=index,
                tree=shape, calibration=None):
            out += round_.tokens
            trees += round_.tree_nodes > 0
            siblings += round_.tree_nodes > 0 and round_.num_accepted > round_.spine_kept
            widest = max(widest, round_.tree_width)
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    return counts, trees, siblings, widest


def test_suffix_trees_at_t1_give_the_target_s_first_two_tokens(models, first_tokens):
    exact, endings = first_tokens
    counts, trees, siblings, widest = _first_pairs(models["plain"], endings, (2, 3), seed=5)
    assert trees >= FIRST_SAMPLES and siblings > FIRST_SAMPLES // 10, (trees, siblings)
    assert widest == 3
    statistic, dof, p_value = chi_square(counts, exact)
    assert p_value > ALPHA, (statistic, dof, p_value)


def _naive(monkeypatch):
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes
    monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)


def test_the_naive_rule_fails_on_suffix_trees_first_two_tokens(models, first_tokens, monkeypatch):
    _naive(monkeypatch)
    exact, endings = first_tokens
    counts, _, _, _ = _first_pairs(models["plain"], endings, (2, 3), seed=5)
    statistic, dof, p_value = chi_square(counts, exact)
    assert p_value < ALPHA, (statistic, dof, p_value)


# Tokens 3-4 after a rejection: a target over 8 tokens (its (t3, t4) enumerated over every
# t1 t2), earlier text that follows the target's two likeliest tokens at each of 4 steps
# (a binary tree of 16 sequences; the prompt's own "3 1 4 1" adds a third candidate).
SMALL_VOCAB = 8
SMALL_PROMPT = [3, 1, 4, 1, 5, 3, 1, 4]
LATER_SAMPLES = 400


@pytest.fixture(scope="module")
def small_target():
    target = make_llama(vocab_size=SMALL_VOCAB, seed=0)
    paths = [[]]
    for _ in range(4):
        ranked = _ranked(target, SMALL_PROMPT, paths)
        paths = [p + [int(ranked[i, r])] for i, p in enumerate(paths) for r in range(2)]
    texts = [SMALL_PROMPT[-3:] + p for p in reversed(paths)]  # the likeliest added last
    return target, texts, exact_third_and_fourth(target, SMALL_PROMPT, SamplingConfig(temp=1.0))


def _later_pairs(target, texts, seed):
    """(t3, t4) counts of LATER_SAMPLES calls at T = 1 with (2, 3) suffix trees from a fresh
    index of `texts`; the calls whose rounds before t3 rejected, the sibling keeps and the
    tree widths seen."""
    mx.random.seed(seed)
    counts, early, siblings, widths = {}, 0, 0, set()
    for _ in range(LATER_SAMPLES):
        out, rejected = [], False
        for round_ in speculative_generate_step(
                SMALL_PROMPT, target, None, max_tokens=4, num_draft_tokens=2,
                sampling=SamplingConfig(temp=1.0), prompt_lookup=False, suffix=_index(*texts),
                tree=(2, 3), calibration=None):
            rejected |= round_.num_accepted < round_.num_drafted and \
                len(out) + len(round_.tokens) < 3
            siblings += round_.tree_nodes > 0 and round_.num_accepted > round_.spine_kept
            widths.add(round_.tree_width)
            out += round_.tokens
        early += rejected
        counts[(out[2], out[3])] = counts.get((out[2], out[3]), 0) + 1
    return counts, early, siblings, widths


def test_tokens_3_and_4_after_a_rejected_suffix_tree_are_the_target_s(small_target):
    target, texts, exact = small_target
    counts, early, siblings, widths = _later_pairs(target, texts, seed=9)
    assert early > LATER_SAMPLES // 2 and siblings > LATER_SAMPLES // 4, (early, siblings)
    assert {2, 3} <= widths, widths
    statistic, dof, p_value = chi_square(counts, exact)
    assert p_value > ALPHA, (statistic, dof, p_value)


def test_the_naive_rule_fails_on_tokens_3_and_4(small_target, monkeypatch):
    _naive(monkeypatch)
    target, texts, exact = small_target
    counts, _, _, _ = _later_pairs(target, texts, seed=9)
    statistic, dof, p_value = chi_square(counts, exact)
    assert p_value < ALPHA, (statistic, dof, p_value)
