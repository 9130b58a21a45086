"""Token trees on sliding-window caches (issue 66): WindowKVCache layers verify trees.

Windows of 3-8 tokens, so they bind within each test, and a small buffer step (`STEP`), so
buffers compact (their start moves) within a test too:

- a tree pass gives every node the logits of its path decoded alone, and after keep_path the
  cache holds what decoding the accepted path alone leaves (offset, every entry a query or a
  rewind may read, by position), and a rewind and a pass after it give the same logits: before
  and after the window binds, a window smaller than the tree's depth, kept first tokens
  (the tree inside them, too), a buffer whose start moves during the tree pass; an
  all-sliding llama, a gemma3_text hybrid (sliding and global layers, a rope per kind) and
  gpt_oss (alternating, attention sinks);
- a tree that is a chain gets the mask the cache itself gives a chain (one window rule);
- greedy parity over 120 tokens with trees from the draft model and prompt lookup against
  mlx-lm's own generate_step on its RotatingKVCache, hybrid and all-sliding targets;
- chi-square at T = 1 on tokens 1-2 and on tokens 3-4 (in most samples drawn after a round
  that rejected part of its tree), trees of width 3 on a gemma3_text target over 8 tokens
  whose window binds from the prompt on; the naive rule (each candidate accepted with
  min(1, p/q) on its own) fails both;
- tree rounds ran (stats.tree_rounds), so nothing passes by falling back to chains.
"""

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_spec.cache.window as window
from families import make_family, shared_family
from mlx_spec.cache import ModelCache, WindowKVCache
from mlx_spec.exactness import chi_square, exact_distribution
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from mlx_spec.stats import StatsRecorder
from mlx_spec.tree import ancestor_mask
from mlx_spec.tree_verify import keep_path, tree_attention, tree_capable, tree_mask
from tiny import make_llama, once, perturbed

ALPHA = 1e-3


@pytest.fixture(autouse=True)
def small_step(monkeypatch):
    """Buffers grow and compact by 8 entries, not 256: starts move within a test."""
    monkeypatch.setattr(window, "STEP", 8)


def _noisy(model, noise, seed):
    """A related-but-worse copy of any model (tiny.perturbed builds llamas only)."""
    clone = type(model)(model.args)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    clone.load_weights([(name, w + noise * mx.std(w) * mx.random.normal(w.shape, key=key))
                        for (name, w), key in zip(params, keys)])
    mx.eval(clone.parameters())
    return clone


@pytest.fixture(scope="module")
def llama():
    return make_llama(seed=0, hidden=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def gemma():
    return make_family("gemma3_text", seed=0, window=8)  # layers 0, 1, 3 slide; 2 is global


# -- one verify pass over a tree ------------------------------------------------------------

PARENTS = (-1, 0, 0, 1, 2, 3, 5, 6)  # depths 0 1 1 2 2 3 4 5: a spine to depth 5, a branch
TOKENS = [11, 12, 21, 22, 31, 41, 51]  # nodes 1..7
KEPT = {"spine": [1, 3, 5, 6, 7], "branch": [2, 4], "none": [], "first": [1]}

# name: (model, window, keep, prompt length, reserve); prompts fed in chunks of CHUNK
CASES = {
    "window 8, not yet full": ("llama", 8, 0, 3, 64),
    "window 8, bound": ("llama", 8, 0, 30, 64),
    "window 4, shallower than the tree": ("llama", 4, 0, 30, 4),
    "window 3 behind 1 kept": ("llama", 4, 1, 30, 4),
    "the tree inside 4 kept": ("llama", 6, 4, 3, 4),
    "start moves in the tree pass": ("llama", 6, 0, 31, 2),
    "gemma3 hybrid, not yet full": ("gemma", None, 0, 3, 64),  # its own window of 8
    "gemma3 hybrid, bound": ("gemma", None, 0, 30, 4),
    "gpt_oss alternating, bound": ("gpt_oss", None, 0, 30, 4),  # attention sinks, MoE
}
CHUNK = 7


def _ancestors(i):
    chain = [i]
    while PARENTS[chain[-1]] >= 0:
        chain.append(PARENTS[chain[-1]])
    return chain[::-1]


def _cache(model, size, keep, reserve, prompt):
    """A ModelCache holding `prompt`, fed in chunks: gemma3's own mix (size None), else
    all-sliding."""
    layers = (model.make_cache() if size is None
              else [WindowKVCache(size, keep, reserve) for _ in model.layers])
    cache = ModelCache(model, layers, reserve=reserve)
    for i in range(0, len(prompt), CHUNK):
        cache.forward(mx.array(prompt[i:i + CHUNK], mx.uint32))
    return cache


def _held(layer, first):
    """(keys, values) of the positions [0, keep) and [first, offset) as `layer` holds them."""
    if not isinstance(layer, WindowKVCache):
        return layer.keys[..., :layer.offset, :], layer.values[..., :layer.offset, :]
    kept = min(layer.keep, layer.offset)
    rows = list(range(kept)) + [layer.keep + p - layer.start
                                for p in range(max(first, kept), layer.offset)]
    index = mx.array(rows)
    return layer.keys[..., index, :], layer.values[..., index, :]


def _same_cache(got, want):
    assert got.length == want.length
    for a, b in zip(got.trimmable, want.trimmable):
        assert a.offset == b.offset and type(a) is type(b)
        first = max(getattr(a, "start", 0), getattr(b, "start", 0))
        if isinstance(a, WindowKVCache):  # both hold the window and one token behind it
            assert first <= max(a.keep, a.offset - a.window())
        for x, y in zip(_held(a, first), _held(b, first)):
            assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4)


@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("case", CASES)
def test_a_tree_pass_on_a_window_is_each_path_decoded_alone(llama, gemma, case, kept):
    name, size, keep, length, reserve = CASES[case]
    model = {"llama": llama, "gemma": gemma}.get(name) or shared_family(name)
    prompt = [(7 * i + 3) % 60 for i in range(length)]
    context, tokens = prompt[:-1], [prompt[-1]] + TOKENS
    target = _cache(model, size, keep, reserve, context)
    assert tree_capable(target)
    windows = [c for c in target.trimmable if isinstance(c, WindowKVCache)]
    assert windows and (name == "llama") == (len(windows) == len(target.trimmable))
    starts = [c.start for c in windows]
    target.anchor()
    with tree_attention(target.trimmable, PARENTS):
        logits = target.forward(mx.array(tokens, mx.uint32))  # (N, V)
    mx.eval(logits)
    if case == "start moves in the tree pass":
        assert all(c.start > s for c, s in zip(windows, starts))
    for i in range(len(PARENTS)):  # node i's logits are its path's, decoded alone
        alone = _cache(model, size, keep, reserve, context)
        want = alone.forward(mx.array([tokens[j] for j in _ancestors(i)], mx.uint32))[-1]
        assert mx.allclose(logits[i], want, atol=1e-3), (case, i)
    path = [0] + KEPT[kept]
    keep_path(target, path)
    alone = _cache(model, size, keep, reserve, context)
    alone.forward(mx.array([tokens[j] for j in path], mx.uint32))
    _same_cache(target, alone)
    for cache in (target, alone):  # a rewind into the accepted path, then a chain's pass
        cache.restore_length(cache.length - 1)
    after = [cache.forward(mx.array([5, 6, 7], mx.uint32)) for cache in (target, alone)]
    assert mx.allclose(after[0], after[1], atol=1e-3)
    _same_cache(target, alone)


@pytest.mark.parametrize("make,window_size", [
    (KVCache, 3),  # a sliding layer on a plain cache: the model's window_size
    (KVCache, None),
    (partial(WindowKVCache, 4, keep=1, reserve=2), None),
    (partial(WindowKVCache, 6, reserve=2), 6),  # gemma3_text asks for its window
    (partial(WindowKVCache, 8, keep=2, reserve=2), 3)])
def test_a_chain_s_tree_mask_is_the_cache_s_own(make, window_size):
    """A tree that is a chain gets the mask the cache itself gives a chain, at every length."""
    layer, chain = make(), tuple(range(-1, 4))  # 5 nodes, each the child of the one before
    ancestors = mx.array(ancestor_mask(chain))
    steps = mx.arange(5)
    for fed in [3, 4, 7, 2, 9, 1]:  # the buffer fills, binds its window, compacts
        ours = tree_mask(layer, ancestors, steps, window_size)
        own = layer.make_mask(5, window_size=window_size, return_array=True)
        assert mx.array_equal(ours, own), fed
        layer.update_and_fetch(mx.zeros((1, 1, fed, 2)), mx.zeros((1, 1, fed, 2)))
    assert isinstance(layer, KVCache) or layer.start > layer.keep


# -- greedy parity --------------------------------------------------------------------------

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
MAX_TOKENS = 120


def _target_alone(pair, model, layers):
    """mlx-lm's own greedy decoding on its own caches (RotatingKVCache for the windows)."""
    return once(("tree-window greedy", pair), lambda: [int(t) for t, _ in generate_step(
        mx.array(PROMPT), model, max_tokens=MAX_TOKENS, prompt_cache=layers,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))], holds=(model,))


def _decode(target, draft, **kwargs):
    out, rounds = [], []
    for round_ in speculative_generate_step(PROMPT, target, draft, max_tokens=MAX_TOKENS,
                                            calibration=None, **kwargs):
        out += round_.tokens
        rounds.append(round_)
    return out, rounds


@pytest.fixture(scope="module")
def pairs(llama, gemma):
    """name: (target, draft, the target's sliding cache list or None for its own)."""
    return {"gemma3 hybrid": (gemma, _noisy(gemma, 0.1, seed=1), None),
            "all sliding, window 8": (llama, perturbed(llama, noise=0.1, seed=1), 8),
            "all sliding, window 3": (llama, perturbed(llama, noise=0.1, seed=1), 3)}


def _layers(model, size):
    return model.make_cache() if size is None else [RotatingKVCache(size) for _ in model.layers]


@pytest.mark.parametrize("source,shape", [("draft", (3, 2)), ("draft", (4, 3)),
                                          ("lookup", (4, 3))])
@pytest.mark.parametrize("pair", ["gemma3 hybrid", "all sliding, window 8",
                                  "all sliding, window 3"])
def test_greedy_trees_on_windows_keep_the_target_s_text(pairs, pair, source, shape):
    target, draft, size = pairs[pair]
    reference = _target_alone(pair, target, _layers(target, size))
    draft = draft if source == "draft" else None
    caches = _layers(target, size) + (_layers(draft, size) if draft else [])  # a window each
    out, rounds = _decode(target, draft, prompt_lookup=source == "lookup",
                          num_draft_tokens=shape[0], tree=shape, prompt_cache=caches)
    assert len(out) == MAX_TOKENS and out == reference
    trees = [r for r in rounds if r.tree_nodes]
    assert trees and all(r.source == source for r in trees)
    assert any(r.num_accepted > r.spine_kept for r in trees)  # a sibling's path was kept
    windows = [c for c in caches if isinstance(c, WindowKVCache)]
    assert windows and all(c.start > c.keep for c in windows)  # the buffers compacted


def test_tree_rounds_ran_on_the_sliding_target(pairs):
    target, draft, size = pairs["all sliding, window 8"]
    caches = _layers(target, size) + _layers(draft, size)
    _, rounds = _decode(target, draft, prompt_lookup=False, num_draft_tokens=3, tree=(3, 2),
                        prompt_cache=caches)
    recorder = StatsRecorder(len(PROMPT))
    for round_ in rounds:
        recorder.record(round_)
    stats = recorder.snapshot()
    assert stats.tree_rounds == len(rounds) > 0
    assert all(isinstance(c, WindowKVCache) for c in caches[:len(target.layers)])


# -- exactness at T = 1 ---------------------------------------------------------------------

V = 8
SMALL_PROMPT = [1, 5, 2, 7, 3, 6]  # longer than the window of 4: it binds from the start
SAMPLES = 250


@pytest.fixture(scope="module")
def small():
    """A sliding target over 8 tokens (gemma3_text, window 4), a related draft, and the exact
    distributions of (t1, t2) and of (t3, t4) after SMALL_PROMPT."""
    target = make_family("gemma3_text", seed=3, vocab_size=V, window=4)
    firsts = exact_distribution(target, SMALL_PROMPT, SamplingConfig(temp=1.0), first_tokens=V)
    return target, _noisy(target, 0.3, seed=2), firsts, _later_pairs_exact(target)


def _later_pairs_exact(target):
    """{(t3, t4): probability} at T = 1, summed over (t1, t2). The model's own forward with
    no cache applies its window (gemma3_text builds the windowed mask itself)."""
    def dist(prefixes):  # (P, L) -> (P, V) next-token probabilities
        return np.array(mx.softmax(target(mx.array(prefixes))[:, -1].astype(mx.float32), -1))
    one = dist([SMALL_PROMPT])[0]
    two = dist([SMALL_PROMPT + [a] for a in range(V)])  # (V, V)
    pairs = [SMALL_PROMPT + [a, b] for a in range(V) for b in range(V)]
    three = dist(pairs)  # (V*V, V)
    four = dist([p + [c] for p in pairs for c in range(V)]).reshape(V * V, V, V)
    weights = (one[:, None] * two).reshape(V * V, 1, 1)
    exact = (weights * three[:, :, None] * four).sum(0)  # (V, V) over (t3, t4)
    return {(c, d): float(exact[c, d]) for c in range(V) for d in range(V)}


def _samples(target, draft, seed):
    """(t1, t2) and (t3, t4) counts of SAMPLES calls at T = 1 drafting 2x3 trees, how many
    calls verified trees only, and how many drew tokens 3-4 after a round that rejected part
    of its tree (the cache compacted to a path, the window bound)."""
    mx.random.seed(seed)
    firsts, laters, trees_only, rejected = {}, {}, 0, 0
    for _ in range(SAMPLES):
        out, trees, rejected_early = [], True, False
        for round_ in speculative_generate_step(
                SMALL_PROMPT, target, draft, max_tokens=4, num_draft_tokens=2,
                sampling=SamplingConfig(temp=1.0), prompt_lookup=False, tree=(2, 3),
                calibration=None):
            out += round_.tokens
            trees &= round_.tree_nodes > 0
            rejected_early |= round_.num_accepted < round_.num_drafted and len(out) <= 2
        trees_only += trees
        rejected += rejected_early
        firsts[tuple(out[:2])] = firsts.get(tuple(out[:2]), 0) + 1
        laters[tuple(out[2:4])] = laters.get(tuple(out[2:4]), 0) + 1
    return firsts, laters, trees_only, rejected


def _p_values(small, seed):
    target, draft, exact_firsts, exact_laters = small
    firsts, laters, trees_only, rejected = _samples(target, draft, seed)
    return chi_square(firsts, exact_firsts)[2], chi_square(laters, exact_laters)[2], \
        trees_only, rejected


def test_tree_rounds_on_a_window_at_t1_give_the_target_s_tokens(small):
    first, later, trees_only, rejected = _p_values(small, seed=9)
    assert trees_only == SAMPLES and rejected > SAMPLES // 2
    assert first > ALPHA and later > ALPHA, (first, later)


def test_the_naive_rule_fails_on_a_window(small, monkeypatch):
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes
    monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    first, later, _, _ = _p_values(small, seed=9)
    assert first < ALPHA and later < ALPHA, (first, later)
