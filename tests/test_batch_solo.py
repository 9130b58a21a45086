"""A row alone on its models' own cache kinds (batch/solo.py): `BatchEngine(max_rows=1)` takes
what a batch cannot hold, one row at a time, exactly (what the server's one-at-a-time mode
serves, with no second engine):

- the families whose code cannot share a batch (kv.UNBATCHABLE), as target and as draft: the
  greedy text the target decodes alone, drafts kept and rejected;
- mlx-lm's kv_bits: the target's attention layers quantized at the token mlx-lm's
  generate_step quantizes them (its greedy text for many k, lookup, a Gated DeltaNet hybrid,
  sliding windows beside a global layer), two turns on the cache a row hands back; the
  control (rounds past the point) gives other text;
- T = 1: tokens 3-4 after a mid-generation rejection, across the point, against the exact
  distribution mlx-lm's quantized cache gives, rows one after another with other prompts
  between them; resampling from p (the control) fails the same test.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx.utils import tree_map

from families import plain_greedy
from test_kv_bits import (GROUP, MID_PROMPT, N, PROMPT, START, _gemma3_text, _qwen3_5,
                          exact_third_and_fourth, mlx_lm_greedy, ours)
from test_unbatchable import make
from tiny import make_llama

from mlx_spec.acceptance import keyed_rule
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.batch.kv import UNBATCHABLE
from mlx_spec.exactness import chi_square
from mlx_spec.sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)


@pytest.fixture(scope="module")
def pair():
    return (make_llama(vocab_size=64, hidden=64, heads=2, seed=0),
            make_llama(vocab_size=64, hidden=64, heads=2, seed=0, weight_scale=2.9))


def decode(engine, prompt, n, sampling=GREEDY, cache=None, cached=0, **request):
    """(tokens, drafted, accepted, the cache handed back) of one row alone."""
    engine.insert(RowRequest(prompt, n, sampling, keep_cache=True, **request), cache, cached)
    tokens, drafted, accepted, kept = [], 0, 0, None
    while engine.busy:
        for out in engine.step():
            tokens += out.tokens
            drafted += out.num_drafted
            accepted += out.num_accepted
            kept = out.cache if out.cache is not None else kept
    return tokens, drafted, accepted, kept


def quantized(target, draft=None, bits=2, start=12, **options):
    return BatchEngine(target, draft, max_rows=1, calibration=None, kv_bits=bits,
                       kv_group_size=GROUP, quantized_kv_start=start, prefill_step_size=4,
                       **options)


# --- families whose code cannot share a batch ---------------------------------------------------

@pytest.mark.parametrize("name", sorted(UNBATCHABLE))
def test_a_family_that_cannot_share_a_batch_decodes_alone_exactly(name):
    target, draft = make(name), make(name, noise=0.05)
    expected = plain_greedy(target, PROMPT, 24)
    with pytest.raises(ValueError, match="one request at a time \\(max_rows=1\\)"):
        BatchEngine(target, draft, max_rows=2)
    for k in (3, None):  # None: the policy's
        engine = BatchEngine(target, draft, max_rows=1, num_draft_tokens=k, calibration=None)
        assert engine.solo
        for _ in range(2):  # a second row on the same engine
            tokens, drafted, accepted, cache = decode(engine, PROMPT, 24)
            assert tokens == expected, k
        if k == 3:
            assert 0 < accepted < drafted
    # as the draft of a target that batches, and the target with no draft
    assert decode(BatchEngine(target, None, max_rows=1, num_draft_tokens=3, calibration=None),
                  PROMPT, 24)[0] == expected
    other = make_llama(vocab_size=64, seed=1)
    engine = BatchEngine(other, draft, max_rows=1, num_draft_tokens=3, calibration=None)
    assert engine.solo and decode(engine, PROMPT, 24)[0] == plain_greedy(other, PROMPT, 24)


def test_a_recurrent_family_the_batch_refuses_rewinds_by_the_model_alone():
    """Baichuan-M1 (its short convolution inside its attention layers): a row alone's verify
    pass goes back by re-running the model over the kept positions (the lazy verify input:
    no host values needed), as a call's; mlx-lm's greedy text."""
    from families import shared_family, shared_plain_greedy

    target = shared_family("baichuan_m1")
    engine = BatchEngine(target, shared_family("baichuan_m1", quantize_bits=4), max_rows=1,
                         num_draft_tokens=3, calibration=None)
    engine.insert(RowRequest(PROMPT, 24, prompt_lookup=False))
    tokens, drafted, accepted, paths = [], 0, 0, set()
    while engine.busy:
        for out in engine.step():
            tokens += out.tokens
            drafted += out.num_drafted
            accepted += out.num_accepted
        if engine.target.cache is not None:
            paths.add(engine.target.cache.rewind_path)
    assert tokens == shared_plain_greedy(target, PROMPT, 24)
    assert 0 < accepted < drafted and "model" in paths
    with pytest.raises(ValueError, match="one request at a time"):
        BatchEngine(target)


def test_chunked_attention_decodes_alone_across_its_chunks():
    """Llama 4's ChunkedKVCache (chunks of 8; the reply crosses three ends)."""
    from test_wrapped_models import make_llama4

    target, draft = make_llama4(), make_llama4(noise=0.05)
    prompt = PROMPT + [11, 2, 8, 30, 1, 9]
    engine = BatchEngine(target, draft, max_rows=1, num_draft_tokens=3, calibration=None)
    tokens, drafted, accepted, _ = decode(engine, prompt, 24, prompt_lookup=False)
    assert tokens == plain_greedy(target, prompt, 24)
    assert 0 < accepted < drafted


# --- kv_bits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,start", [(2, 3), (4, 12), (2, 20)])  # in the prompt; the reply
def test_greedy_tokens_are_mlx_lms_with_kv_bits(pair, bits, start):
    target, draft = pair
    expected = mlx_lm_greedy(target, PROMPT, N, bits, start)
    assert expected != mlx_lm_greedy(target, PROMPT, N, None, 0)  # the quantization shows
    n = len(target.layers)
    for k in (1, 3, 5, None):
        for lookup in (False, None):  # None: prompt lookup in front of the draft
            tokens, _, _, cache = decode(quantized(target, draft, bits, start,
                                                   num_draft_tokens=k), PROMPT, N,
                                         prompt_lookup=lookup)
            assert tokens == expected, (k, lookup)
            assert all(type(layer) is QuantizedKVCache for layer in cache[:n])
            assert all(type(layer) is KVCache for layer in cache[n:])  # the draft's stay


@pytest.mark.parametrize("start", [3, 12])
def test_token_trees_on_the_quantized_cache(pair, start):
    """A call's tree pass on the row's own layers (its depth stopping at the point as a
    chain's), the accepted path gathered in the quantized layers; the policy's width too."""
    target, draft = pair
    expected = mlx_lm_greedy(target, PROMPT, N, 2, start)
    for tree in ((3, 2), (2, 3), None):
        for lookup in (False, True):
            engine = quantized(target, draft, 2, start, tree=tree,
                               num_draft_tokens=3 if tree else None)
            engine.insert(RowRequest(PROMPT, N, GREEDY, prompt_lookup=lookup))
            tokens, trees = [], 0
            while engine.busy:
                for out in engine.step():
                    tokens += out.tokens
                    trees += bool(out.tree_nodes)
            assert tokens == expected, (tree, lookup)
            assert trees > 0 or tree is None


def test_the_shipped_targets_drafters_alone_give_mlx_lms_text():
    """The draft model, the target's MTP head and its DFlash drafter on a row alone's quantized
    cache (the heads read the target's states from the row's own passes): mlx-lm's text."""
    from mlx_spec import load_default_pair
    from mlx_spec.default_models import DEFAULT_DFLASH_PATH
    from mlx_spec.dflash import load_dflash

    target, draft, tokenizer = load_default_pair()
    prompt = tokenizer.encode("import os\n\ndef main():")
    expected = [int(t) for t, _ in generate_step(
        mx.array(prompt), target, max_tokens=N, sampler=lambda lp: mx.argmax(lp, axis=-1),
        kv_bits=4, kv_group_size=64, quantized_kv_start=10)]
    for drafter in (draft, "mtp", load_dflash(DEFAULT_DFLASH_PATH)):
        engine = BatchEngine(target, drafter, max_rows=1, calibration=None, kv_bits=4,
                             kv_group_size=64, quantized_kv_start=10)
        tokens, _, accepted, cache = decode(engine, prompt, N)
        assert tokens == expected and accepted > 0, drafter
        assert any(type(layer) is QuantizedKVCache for layer in cache)


def test_a_rows_own_k_stops_at_the_point_too(pair):
    """A row's pinned k (its request's num_draft_tokens, the server's --fixed) never drafts
    past the point either (the engine's k did not reach it: review of 4a01613)."""
    target, draft = pair
    expected = mlx_lm_greedy(target, PROMPT, N, 2, 12)
    for k in (3, 5):
        tokens, drafted, _, _ = decode(quantized(target, draft), PROMPT, N, num_draft_tokens=k,
                                       prompt_lookup=False)
        assert tokens == expected and drafted > 0, k


def test_the_control_rounds_past_the_point_change_the_text(pair, monkeypatch):
    target, draft = pair
    expected = mlx_lm_greedy(target, PROMPT, N, 2, 12)
    assert decode(quantized(target, draft, num_draft_tokens=5), PROMPT, N,
                  prompt_lookup=False)[0] == expected
    monkeypatch.setattr(BatchEngine, "_fits", lambda self: None)
    got = [decode(quantized(target, draft, num_draft_tokens=k), PROMPT, N,
                  prompt_lookup=False)[0] for k in (3, 5)]
    assert all(tokens != expected for tokens in got)


@pytest.mark.parametrize("start", [12, 8 + 20 - 1, 8 + 20])  # in the reply; at its last tokens
def test_two_turns_on_the_cache_a_row_hands_back_are_mlx_lms(pair, start):
    """The second turn continues the cache the first handed back (quantized where mlx-lm's
    generate_step leaves its cache after the same two turns on one cache)."""
    target, draft = pair
    engine = quantized(target, draft, 2, start, num_draft_tokens=3)
    first, _, _, cache = decode(engine, PROMPT, 20)
    second_prompt = [7, 7, 30, 2]
    history = PROMPT + first + second_prompt
    second, _, _, _ = decode(engine, history, 20, cache=cache, cached=len(PROMPT) + len(first))
    reference = make_prompt_cache(target)
    expected = [[int(t) for t, _ in generate_step(
        mx.array(prompt), target, max_tokens=20, prompt_cache=reference,
        sampler=lambda lp: mx.argmax(lp, axis=-1), kv_bits=2, kv_group_size=GROUP,
        quantized_kv_start=start)] for prompt in (PROMPT, second_prompt)]
    assert [first, second] == expected


def test_a_hybrid_and_a_sliding_window_target_with_kv_bits():
    """Qwen3.5's attention layers quantized, its recurrent state restored and replayed as a
    call's (drafts rejected): mlx-lm's text; Gemma 3's global layer quantized, its windows
    rewindable: the text a call decodes alone with the same kv_bits."""
    import mlx.nn as nn

    target, draft = _qwen3_5(), _qwen3_5()
    nn.quantize(draft, group_size=32, bits=4,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    expected = mlx_lm_greedy(target, PROMPT, N, 2, 12)
    for k in (2, 4):
        tokens, drafted, accepted, _ = decode(quantized(target, draft, num_draft_tokens=k),
                                              PROMPT, N, prompt_lookup=False)
        assert tokens == expected, k
        assert 0 < accepted < drafted
    target, draft = _gemma3_text(), _gemma3_text()
    draft.update(tree_map(lambda w: w * 0.97 if w.ndim >= 2 else w, draft.parameters()))
    expected = ours(target, None, PROMPT, N, 2, 12, prompt_lookup=False)[0]  # (mlx-lm cannot
    # quantize a window: a call with no draft, its global layer quantized, tests/test_kv_bits)
    for k in (2, 4):
        tokens, drafted, accepted, cache = decode(quantized(target, draft, num_draft_tokens=k),
                                                  PROMPT, N, prompt_lookup=False)
        assert tokens == expected, k
        assert 0 < accepted < drafted
        kinds = [type(layer).__name__ for layer in cache[:len(target.layers)]]
        assert kinds[2] == "QuantizedKVCache" and kinds.count("QuantizedKVCache") == 1


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_tokens_after_a_rejection_across_the_point_match_the_target(residual, exact):
    """Rows of MID_PROMPT one at a time (other prompts between them), 2 drafts a round, the
    cache quantized at token START (inside the first round's reach)."""
    import random

    target = make_llama(vocab_size=8, hidden=64, heads=2, seed=0)
    draft = make_llama(vocab_size=8, seed=7, hidden=32, layers=1)
    sampling = SamplingConfig(temp=1.0)
    mx.random.seed(0)
    engine = BatchEngine(target, draft, max_rows=1, calibration=None, num_draft_tokens=2,
                         accept=keyed_rule(residual), kv_bits=4, kv_group_size=GROUP,
                         quantized_kv_start=START)
    rng, counts, rewound, first_drafts, samples = random.Random(0), {}, 0, set(), 600
    while sum(counts.values()) < samples:
        if rng.random() < 0.3:  # another prompt between two rows
            decode(engine, [rng.randrange(8) for _ in range(rng.randrange(1, 7))], 3, sampling)
        engine.insert(RowRequest(MID_PROMPT, 4, sampling))
        out, early, first = [], False, True
        while engine.busy:
            for o in engine.step():
                if first:
                    first_drafts.add(o.num_drafted)
                    first = False
                if o.num_accepted < o.num_drafted and len(out) + len(o.tokens) < 3:
                    early = True
                out += o.tokens
        rewound += early
        counts[tuple(out[2:4])] = counts.get(tuple(out[2:4]), 0) + 1
    assert first_drafts == {1}  # the first round stops at the point: one draft, not two
    assert rewound > samples // 3, rewound
    _, _, p_value = chi_square(counts, exact_third_and_fourth(target, sampling, 4))
    assert (p_value > 1e-3) == exact, p_value


def test_bad_input_is_one_sentence(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="decoded one request at a time.*max_rows=1"):
        BatchEngine(target, draft, kv_bits=4, kv_group_size=GROUP)
    with pytest.raises(ValueError, match="kv_bits must be None or one of"):
        BatchEngine(target, draft, max_rows=1, kv_bits=7)
    with pytest.raises(ValueError, match="which kv_group_size 64 does not divide"):
        BatchEngine(target, draft, max_rows=1, kv_bits=4, kv_group_size=64)
