"""The verdict of a verified chain (judge.py), one implementation for both engines.

Each shared part is checked on its own and then through the single-sequence
loop and the batch engine with the same expectations: the greedy prefix match,
the residual rule's ship-and-read, and the stop cut.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny import make_llama, perturbed

from mlx_spec.acceptance import greedy_accept, keyed_rule, speculative_accept
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.cache import ModelCache, make_cache
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.judge import (prefix_match, read_verdict, stop_cut, verdict_parts,
                            verdict_size)
from mlx_spec.loop import generate_rounds
from mlx_spec.policy import FixedPolicy
from mlx_spec.sampling import SamplingConfig

V = 32


def test_prefix_match_counts_leading_equal_drafts_only():
    assert prefix_match([], [5]) == 0
    assert prefix_match([1, 2, 3], [1, 2, 3, 9]) == 3
    assert prefix_match([1, 2, 3], [1, 7, 3, 9]) == 1
    assert prefix_match([4, 2], [1, 2, 3]) == 0


def test_stop_cut_keeps_the_first_stop_token_and_nothing_after():
    assert stop_cut([1, 2, 3], {9}) == [1, 2, 3]
    assert stop_cut([1, 9, 3, 9], {9}) == [1, 9]
    assert stop_cut([9], {9}) == [9]
    assert stop_cut([1, 2, 3], ()) == [1, 2, 3]


def one_hot(tokens):
    return mx.eye(V)[mx.array(tokens)]


def test_a_greedy_verdict_reads_back_the_argmax_walk():
    target = [3, 5, 7, 11]  # the argmax at each of k + 1 = 4 positions
    logits = one_hot(target) * 10.0
    for drafts, kept in (([3, 5, 7], 3), ([3, 6, 7], 1), ([0, 5, 7], 0)):
        parts = verdict_parts(greedy_accept, mx.array(drafts, mx.uint32), None, logits, None)
        assert parts.shape[0] == verdict_size(3, greedy=True)
        n, token, drafted, chances = read_verdict(parts.tolist(), 3, greedy=True)
        assert (n, token, drafted, chances) == (kept, target[kept], drafts, None)


@pytest.mark.parametrize("chances", [False, True])
def test_a_residual_verdict_ships_n_token_drafts_and_chances(chances):
    # p is one-hot on the drafts for two positions, then on 9: q = p keeps both, the bonus is 9
    drafts = [4, 6]
    logprobs = mx.log(one_hot(drafts + [9]) * (1 - 1e-6) + 1e-6 / V)
    parts = verdict_parts(speculative_accept, mx.array(drafts, mx.uint32), one_hot(drafts),
                          logprobs, logprobs, chances=chances)
    assert parts.shape[0] == verdict_size(2, greedy=False, chances=chances)
    n, token, drafted, kept = read_verdict(parts.tolist(), 2, greedy=False, chances=chances)
    assert (n, token, drafted) == (2, 9, drafts)
    if chances:
        assert kept == pytest.approx([1.0, 1.0], abs=1e-4)
    else:
        assert kept is None


def test_a_keyed_verdict_with_no_drafts_is_the_targets_own_draw():
    logprobs = mx.log(one_hot([2]) * (1 - 1e-6) + 1e-6 / V)
    parts = verdict_parts(keyed_rule(), mx.zeros((0,), mx.uint32), None, logprobs, logprobs,
                          key=mx.random.key(0))
    assert read_verdict(parts.tolist(), 0, greedy=False) == (0, 2, [], None)


# --- the same expectations through both engines -------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = make_llama(vocab_size=V, seed=3)
    return target, perturbed(target, noise=0.3)


def solo(target, draft, prompt, k, max_tokens, stop_tokens=()):
    """(tokens, rounds) of the single-sequence loop at a fixed k."""
    drafter = DraftModelDrafter(draft, SamplingConfig(), V)
    out, rounds = [], []
    for round_ in generate_rounds(prompt, ModelCache(target, make_cache(target)), [drafter],
                                  FixedPolicy(k), sampling=SamplingConfig(),
                                  max_tokens=max_tokens, stop_tokens=stop_tokens):
        out += round_.tokens
        rounds.append(round_)
    return out, rounds


def batched(target, draft, prompt, k, max_tokens, stop_tokens=()):
    """(tokens, outputs) of the same prompt as a row of the batch engine at the same k."""
    engine = BatchEngine(target, draft, num_draft_tokens=k, stop_tokens=stop_tokens)
    engine.insert(RowRequest(prompt, max_tokens, prompt_lookup=False))
    out, outputs = [], []
    while engine.busy:
        for o in engine.step():
            out += o.tokens
            outputs.append(o)
    return out, outputs


PROMPT = [1, 7, 3, 9, 12, 5, 7, 3]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_both_engines_keep_the_same_drafts_round_by_round(pair, k):
    target, draft = pair
    tokens, rounds = solo(target, draft, PROMPT, k, 40)
    same, outputs = batched(target, draft, PROMPT, k, 40)
    assert same == tokens
    assert [(r.num_drafted, r.num_accepted) for r in rounds] == \
        [(o.num_drafted, o.num_accepted) for o in outputs]
    assert any(r.num_accepted < r.num_drafted for r in rounds)  # rejections happened
    assert any(r.num_accepted > 0 for r in rounds)  # and matches


def test_both_engines_stop_at_an_accepted_stop_token_mid_chain(pair):
    target, _ = pair
    reference, _ = solo(target, target, PROMPT, 4, 30)  # the target drafting: all kept
    # a token first met inside a round's accepted drafts, not as its last token
    stop = next(t for i, t in enumerate(reference) if i % 5 not in (4,) and i > 2
                and t not in reference[:i])
    expected = reference[:reference.index(stop) + 1]
    tokens, rounds = solo(target, target, PROMPT, 4, 30, stop_tokens={stop})
    assert tokens == expected
    assert rounds[-1].tokens[-1] == stop
    same, outputs = batched(target, target, PROMPT, 4, 30, stop_tokens={stop})
    assert same == expected
    assert outputs[-1].finish_reason == "stop"
