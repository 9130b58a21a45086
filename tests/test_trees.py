"""Token trees (issue 66): the tree maths, one verify pass over a tree, exact acceptance.

- the parent-array maths against a brute-force walk up the parents;
- a tree pass gives every node the logits of its path decoded alone (positions by depth,
  ancestor mask), and after keep_path the cache holds what decoding the accepted path alone
  leaves (keys and values compared), plain and quantized caches;
- greedy parity over 100+ tokens with trees of several shapes from the draft model and
  prompt lookup, on a plain and a quantized target;
- chi-square at T = 1: the multi-candidate rule over random trees (i.i.d. candidates with
  replacement, and one-hot lookup candidates), and end to end the first two tokens with
  trees of width 2-3 (the second follows a rejection in the first round in most samples);
  the naive rule (each candidate accepted with min(1, p/q) on its own) fails each.
"""

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlx_spec.cache import ModelCache
from mlx_spec.exactness import chi2_survival, chi_square, exact_distribution
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from mlx_spec.tree import (ancestor_mask, bfs_order, check_parents, children, depths, from_paths,
                           paths, spine_and_siblings)
from mlx_spec.tree_acceptance import tree_outcomes, walk
from mlx_spec.tree_verify import keep_path, tree_attention, tree_capable
from families import shared_family
from tiny import make_llama, perturbed

ALPHA = 1e-3
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


def naive_tree_outcomes(*args, **kwargs):
    """The NAIVE tree rule (tree_outcomes' residual=False): the negative control."""
    return tree_outcomes(*args, **{**kwargs, "residual": False})


def random_parents(n, rng):
    return (-1,) + tuple(rng.randrange(i) for i in range(1, n))


def _ancestors(parents, i):
    chain = [i]
    while parents[chain[-1]] >= 0:
        chain.append(parents[chain[-1]])
    return chain


@pytest.mark.parametrize("seed", range(20))
def test_the_tree_maths_match_a_walk_up_the_parents(seed):
    rng = random.Random(seed)
    parents = random_parents(rng.randrange(1, 14), rng)
    check_parents(parents)
    mask, d = ancestor_mask(parents), depths(parents)
    for i in range(len(parents)):
        up = _ancestors(parents, i)
        assert set(np.flatnonzero(mask[i])) == set(up)
        assert d[i] == len(up) - 1
    leaves = [i for i in range(len(parents)) if i not in parents]
    assert paths(parents) == [list(reversed(_ancestors(parents, leaf))) for leaf in leaves]
    order = bfs_order(parents)
    assert sorted(order) == list(range(len(parents)))
    assert all(order.index(parents[i]) < order.index(i) for i in range(1, len(parents)))
    assert [list(d[order])] == [sorted(d)]


@pytest.mark.parametrize("seed", range(10))
def test_a_trie_of_paths_holds_each_path_once(seed):
    rng = random.Random(seed)
    token_paths = [[rng.randrange(3) for _ in range(rng.randrange(1, 5))] for _ in range(4)]
    parents, tokens = from_paths(token_paths)
    check_parents(parents)
    assert list(depths(parents)) == sorted(depths(parents))  # BFS order
    walked = {tuple(tokens[i] for i in path[1:]) for path in paths(parents)}
    for path in token_paths:  # every path is a root path of the trie
        assert any(w[:len(path)] == tuple(path) for w in walked)
    kids = children(parents)
    for k in kids:  # siblings are distinct tokens
        assert len({tokens[c] for c in k}) == len(k)


def test_bad_parent_arrays_are_refused_in_one_sentence():
    for bad in [(), (0,), (-1, 1), (-1, 0, 3)]:
        with pytest.raises(ValueError, match="parent"):
            check_parents(bad)
    assert spine_and_siblings(2, 3) == (-1, 0, 0, 0, 1, 1, 1)


# -- one verify pass over a tree ------------------------------------------------------------

SHAPE = dict(hidden=64, heads=2, kv_heads=1)  # head dimension 32: a quantization group


def _quantized(model):
    nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def models():
    target = make_llama(seed=0, **SHAPE)
    return {"plain": target, "quantized": _quantized(make_llama(seed=0, **SHAPE)),
            "draft": perturbed(target, noise=0.1, seed=1)}


def _layers(model, kind):
    if kind == "quantized-kv":
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    return [KVCache() for _ in model.layers]


def _arrays(layer):
    keys, values = (tuple(a[..., :layer.offset, :] for a in arrays) if isinstance(arrays, tuple)
                    else arrays[..., :layer.offset, :] for arrays in (layer.keys, layer.values))
    if isinstance(keys, tuple):  # quantized: compare what attention reads
        keys = mx.dequantize(*keys, group_size=layer.group_size, bits=layer.bits)
        values = mx.dequantize(*values, group_size=layer.group_size, bits=layer.bits)
    return keys, values


@pytest.mark.parametrize("kind", ["plain", "quantized-kv"])
@pytest.mark.parametrize("kept", [[2, 6], [1, 4, 7], [3], []])
def test_a_tree_pass_is_each_path_decoded_alone_and_the_cache_keeps_the_path(models, kind, kept):
    model = models["plain"]
    parents = (-1, 0, 0, 0, 1, 2, 2, 4)  # node 0: the last prompt token
    tokens = [PROMPT[-1], 11, 12, 13, 21, 22, 23, 31]
    target = ModelCache(model, _layers(model, kind))
    assert tree_capable(target)
    target.forward(mx.array(PROMPT[:-1], mx.uint32))
    target.anchor()
    with tree_attention(target.trimmable, parents):
        logits = target.forward(mx.array(tokens, mx.uint32))  # (N, V)
    for i in range(len(parents)):  # node i's logits are its path's, decoded alone
        path = list(reversed([tokens[j] for j in _ancestors(parents, i)]))
        alone = ModelCache(model, _layers(model, kind))
        want = alone.forward(mx.array(PROMPT[:-1] + path, mx.uint32))[-1]
        assert mx.allclose(logits[i], want, atol=1e-3 if kind == "plain" else 5e-2), i
    keep_path(target, [0] + kept)
    alone = ModelCache(model, _layers(model, kind))
    alone.forward(mx.array(PROMPT[:-1] + [tokens[0]] + [tokens[i] for i in kept], mx.uint32))
    assert target.length == alone.length
    for got, want in zip(target.trimmable, alone.trimmable):
        assert got.offset == want.offset
        for a, b in zip(_arrays(got), _arrays(want)):
            assert mx.allclose(a, b, atol=1e-4 if kind == "plain" else 3e-2)


# -- greedy parity --------------------------------------------------------------------------

def _decode(target, draft, **kwargs):
    out, rounds = [], []
    for round_ in speculative_generate_step(PROMPT, target, draft, max_tokens=120,
                                            calibration=None, **kwargs):
        out += round_.tokens
        rounds.append(round_)
    return out, rounds


@pytest.mark.parametrize("target_kind", ["plain", "quantized"])
@pytest.mark.parametrize("source,shape", [("draft", (2, 2)), ("draft", (4, 3)),
                                          ("draft", (3, 1)), ("lookup", (4, 3)),
                                          ("lookup", (6, 2))])
def test_greedy_trees_keep_the_target_s_text(models, target_kind, source, shape):
    target = models[target_kind]
    reference, _ = _decode(target, None, prompt_lookup=False)
    draft = models["draft"] if source == "draft" else None
    out, rounds = _decode(target, draft, prompt_lookup=source == "lookup",
                          num_draft_tokens=shape[0], tree=shape)
    assert len(out) == 120 and out == reference
    trees = [r for r in rounds if r.tree_nodes]
    assert trees and all(r.source == source for r in trees)
    assert all(r.num_drafted <= shape[0] for r in trees)


def test_trees_off_and_where_they_cannot_be_verified_keep_chains(models):
    target = models["plain"]
    _, rounds = _decode(target, models["draft"], prompt_lookup=False, num_draft_tokens=3,
                        tree=False)
    assert not any(r.tree_nodes for r in rounds)
    _, rounds = _decode(target, models["draft"], prompt_lookup=False, num_draft_tokens=3)
    assert not any(r.tree_nodes for r in rounds)  # None: the policy's choice, chains for now
    # Recurrent state (Gated DeltaNet) keeps chains; sliding windows verify trees
    # (tests/test_trees_window.py).
    _, rounds = _decode(shared_family("qwen3_5"), models["draft"], prompt_lookup=False,
                        num_draft_tokens=3, tree=(3, 2))
    assert rounds and not any(r.tree_nodes for r in rounds)


@pytest.mark.parametrize("bad", [(0, 2), (2,), "3x2", True, (2, 2.5)])
def test_a_bad_tree_argument_is_refused_in_one_sentence(models, bad):
    with pytest.raises(ValueError, match="tree must be"):
        _decode(models["plain"], None, tree=bad)


# -- exactness at T = 1 ---------------------------------------------------------------------

def _chi_square(counts, probs):
    """(statistic, dof, p) of counts over tokens against exact `probs`, cells below 5
    expected pooled; a token with probability 0 that was drawn fails outright."""
    n = counts.sum()
    if (counts[probs <= 0] > 0).any():
        return float("inf"), 1, 0.0
    big = probs * n >= 5
    obs = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    exp = list(probs[big] * n) + ([probs[~big].sum() * n] if (~big).any() else [])
    obs, exp = np.array(obs, float), np.array(exp, float)
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = max(len(obs) - 1, 1)
    return statistic, dof, chi2_survival(statistic, dof)


V = 8


def _rule_samples(samples, residual, lookup, seed):
    """The first emitted token of `samples` tree rounds over fixed p and q: a root with three
    candidates (i.i.d. from q with replacement, or distinct lookup tokens with one-hot q), the
    first of which has two children of its own. Returns (counts (V,), exact p at the root)."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    p_root = np.array([0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
    q_root = np.array([0.05, 0.05, 0.30, 0.25, 0.05, 0.20, 0.05, 0.05])  # a poor draft
    p_child, q_child = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    parents = (-1, 0, 0, 0, 1, 1)
    target_logprobs = mx.log(mx.array(np.stack([p_root] + [p_child] * 5), mx.float32))
    counts = np.zeros(V, int)
    for _ in range(samples):
        if lookup:  # deterministic distinct candidates: a point mass each
            first = rng.choice(V, 3, replace=False)
            second = rng.choice(V, 2, replace=False)
            drafted = np.concatenate([first, second])
            q = np.eye(V)[drafted]
        else:  # i.i.d. from q, with replacement
            drafted = np.concatenate([rng.choice(V, 3, p=q_root), rng.choice(V, 2, p=q_child)])
            q = np.stack([q_root] * 3 + [q_child] * 2)
        slot, token = tree_outcomes(parents, mx.array(drafted, mx.uint32),
                                    mx.array(q, mx.float32), target_logprobs, residual=residual)
        path, next_token = walk(parents, slot.tolist(), token.tolist())
        first_token = int(drafted[path[0] - 1]) if path else next_token
        counts[first_token] += 1
    return counts, p_root


@pytest.mark.parametrize("lookup", [False, True])
def test_the_multi_candidate_rule_keeps_p(lookup):
    counts, p = _rule_samples(3000, residual=True, lookup=lookup, seed=3)
    statistic, dof, p_value = _chi_square(counts, p)
    assert p_value > ALPHA, (statistic, dof, p_value, counts)


def test_the_naive_rule_accepting_each_candidate_on_its_own_fails():
    counts, p = _rule_samples(3000, residual=False, lookup=False, seed=3)
    statistic, dof, p_value = _chi_square(counts, p)
    assert p_value < ALPHA, (statistic, dof, p_value, counts)


def _pairs(target, draft, samples, shape, seed):
    """(t1, t2) counts of `samples` calls at T = 1, drafting trees of `shape`."""
    mx.random.seed(seed)
    counts, trees = {}, 0
    for _ in range(samples):
        out = []
        for round_ in speculative_generate_step(
                SHORT_PROMPT, target, draft, max_tokens=2, num_draft_tokens=shape[0],
                sampling=SamplingConfig(temp=1.0), prompt_lookup=draft is None, tree=shape,
                calibration=None):
            out += round_.tokens
            trees += round_.tree_nodes > 0
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    return counts, trees


SHORT_PROMPT = [3, 1, 4, 1, 3, 1, 5, 1]  # lookup: "1" was followed by 4, 3 and 5
END_TO_END_SAMPLES = 600


@pytest.fixture(scope="module")
def exact_pairs(models):
    return exact_distribution(models["plain"], SHORT_PROMPT, SamplingConfig(temp=1.0))


@pytest.mark.parametrize("source,shape", [("draft", (2, 3)), ("lookup", (2, 3))])
def test_tree_rounds_at_t1_give_the_target_s_first_two_tokens(models, exact_pairs, source, shape):
    draft = make_llama(seed=7, hidden=32, layers=1) if source == "draft" else None  # a poor one
    counts, trees = _pairs(models["plain"], draft, END_TO_END_SAMPLES, shape, seed=5)
    assert trees >= END_TO_END_SAMPLES  # every sample drafted a tree, most two
    statistic, dof, p_value = chi_square(counts, exact_pairs)
    assert p_value > ALPHA, (statistic, dof, p_value)


def test_the_naive_rule_fails_the_same_test(models, exact_pairs, monkeypatch):
    import mlx_spec.tree_acceptance as tree_acceptance
    monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    draft = make_llama(seed=7, hidden=32, layers=1)
    counts, _ = _pairs(models["plain"], draft, END_TO_END_SAMPLES, (2, 3), seed=5)
    statistic, dof, p_value = chi_square(counts, exact_pairs)
    assert p_value < ALPHA, (statistic, dof, p_value)


def test_the_command_line_takes_a_tree_shape_and_the_stats_count_tree_rounds(models):
    from mlx_spec.cli.generate import tree_shape
    from mlx_spec.stats import StatsRecorder

    assert tree_shape("auto") is None and tree_shape("off") is False
    assert tree_shape("3x2") == (3, 2)
    for bad in ["3", "0x2", "x", "3x2x1", "ax2"]:
        with pytest.raises(Exception, match="DEPTHxWIDTH"):
            tree_shape(bad)
    _, rounds = _decode(models["plain"], models["draft"], prompt_lookup=False,
                        num_draft_tokens=3, tree=(3, 2))
    recorder = StatsRecorder(len(PROMPT))
    for round_ in rounds:
        recorder.record(round_)
    stats = recorder.snapshot()
    assert stats.tree_rounds == len(rounds)
    assert stats.tree_nodes == sum(r.tree_nodes for r in rounds) > 5 * len(rounds)
    assert "Token trees: " in stats.summary()


# Tokens 3-4 after rejections: a target over 8 tokens, whose exact distribution of (t3, t4)
# sums over every (t1, t2); a related draft, so that a round often keeps a sibling (a
# compacted cache) or rejects mid-tree before tokens 3-4 are drawn.
SMALL = dict(vocab_size=8, hidden=64, heads=2, kv_heads=1)
SMALL_PROMPT = [1, 5, 2, 7, 3]
LATER_SAMPLES = 400


def _later_pairs_exact(target):
    """{(t3, t4): probability} at T = 1 after SMALL_PROMPT, summed over (t1, t2)."""
    def dist(prefixes):  # (P, L) -> (P, V) next-token probabilities
        return mx.softmax(target(mx.array(prefixes))[:, -1].astype(mx.float32), axis=-1)
    exact = np.zeros((V, V))
    one = np.array(dist([SMALL_PROMPT])[0])
    pairs = [SMALL_PROMPT + [a, b] for a in range(V) for b in range(V)]
    two = np.array(dist([SMALL_PROMPT + [a] for a in range(V)]))
    three = np.array(dist(pairs))  # (64, V)
    four = np.array(dist([p + [c] for p in pairs for c in range(V)]))  # (512, V)
    for i, (a, b) in enumerate((a, b) for a in range(V) for b in range(V)):
        weight = one[a] * two[a, b]
        exact += weight * three[i][:, None] * four[i * V:(i + 1) * V]
    return {(c, d): float(exact[c, d]) for c in range(V) for d in range(V)}


def _later_pairs(target, draft, samples, seed):
    mx.random.seed(seed)
    counts, kept_sibling = {}, 0
    for _ in range(samples):
        out = []
        for round_ in speculative_generate_step(
                SMALL_PROMPT, target, draft, max_tokens=4, num_draft_tokens=2,
                sampling=SamplingConfig(temp=1.0), prompt_lookup=False, tree=(2, 3),
                calibration=None):
            if len(out) < 2 and round_.num_accepted and len(out) + len(round_.tokens) < 4:
                kept_sibling += 1  # (a kept draft before tokens 3-4: compacted or trimmed)
            out += round_.tokens
        key = (out[2], out[3], -1)[:2]
        counts[key] = counts.get(key, 0) + 1
    return counts, kept_sibling


@pytest.fixture(scope="module")
def small_pair():
    target = make_llama(seed=3, **SMALL)
    return target, perturbed(target, noise=0.3, seed=2), _later_pairs_exact(target)


def _pooled(counts, exact):
    """chi_square's (t1, t2) keys over (t3, t4): every cell resolved."""
    return chi_square({(a, b): n for (a, b), n in counts.items()},
                      {(a, b): p for (a, b), p in exact.items()})


def test_tokens_3_and_4_after_tree_rounds_are_the_target_s(small_pair):
    target, draft, exact = small_pair
    counts, kept = _later_pairs(target, draft, LATER_SAMPLES, seed=9)
    assert kept > LATER_SAMPLES // 4
    statistic, dof, p_value = _pooled(counts, exact)
    assert p_value > ALPHA, (statistic, dof, p_value)


def test_the_naive_rule_fails_on_tokens_3_and_4(small_pair, monkeypatch):
    import mlx_spec.tree_acceptance as tree_acceptance
    monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    target, draft, exact = small_pair
    counts, _ = _later_pairs(target, draft, LATER_SAMPLES, seed=9)
    statistic, dof, p_value = _pooled(counts, exact)
    assert p_value < ALPHA, (statistic, dof, p_value)
