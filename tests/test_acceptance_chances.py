"""Each round's acceptance chances at T > 0 (what the policy learns acceptance from).

`Round.chances[i]` is the chance the residual rule keeps draft i given the
drafts before it, sum_x min(p_i(x), q_i(x)). Checked three ways: against a
from-scratch computation of p and q for the first draft, by the frequency with
which real rounds keep their first draft (it must match the mean chance), and
by the policy telling a good source from a poor one after a single round,
where the kept count cannot (with SOFT_ACCEPTANCE off, the negative control).
"""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import policy as policy_module
from mlx_spec.acceptance import _rejection_sample, acceptance_chances, keyed_rule
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loop import Round
from mlx_spec.policy import SourceEstimate, expected_kept
from mlx_spec.sampling import SamplingConfig, logprobs_from_logits, probs_from_logits

PROMPT = [3, 1, 4, 1, 5]


def rounds(target, draft, temp, k, tokens=60, seed=0):
    mx.random.seed(seed)
    return [r for r in speculative_generate_step(
        PROMPT, target, draft, max_tokens=tokens, sampling=SamplingConfig(temp=temp),
        num_draft_tokens=k, prompt_lookup=False) if r.num_drafted]


def test_acceptance_chances_is_the_overlap_of_p_and_q():
    p = mx.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = mx.array([[0.2, 0.6, 0.2], [0.0, 1.0, 0.0]])
    got = acceptance_chances(mx.array([1, 1], mx.uint32), q, mx.log(mx.concatenate(
        [p, mx.array([[1 / 3] * 3])])))
    assert np.allclose(np.array(got), [0.2 + 0.3 + 0.2, 0.1], atol=1e-6)


@pytest.mark.parametrize("residual", [True, False])
def test_a_keyed_rule_with_chances_draws_what_it_draws_without(residual):
    """A batch row's rule (compiled) and its chances from one p: the same (n, token) as the
    rule alone and as the uncompiled rule with the same key, and acceptance_chances' values."""
    rule = keyed_rule(residual)
    k, vocab = 4, 50
    for seed in range(12):
        keys = mx.random.split(mx.random.key(seed), 3)
        q = mx.softmax(mx.random.normal((k, vocab), key=keys[0]) * 2.0, axis=-1)
        logprobs = logprobs_from_logits(mx.random.normal((k + 1, vocab), key=keys[1]) * 2.0,
                                        SamplingConfig(temp=1.0))
        drafts = mx.random.categorical(mx.log(q), key=keys[2]).astype(mx.uint32)
        key = mx.random.key(100 + seed)
        n, token, chances = (np.array(v) for v in rule.with_chances(drafts, q, logprobs, key))
        alone = [int(np.array(v)) for v in rule(drafts, q, logprobs, key)]
        uncompiled = [int(np.array(v)) for v in _rejection_sample(drafts, q, logprobs,
                                                                   residual, key)]
        assert [int(n), int(token)] == alone == uncompiled
        assert np.allclose(chances, np.array(acceptance_chances(drafts, q, logprobs)),
                           atol=1e-6)


@pytest.mark.parametrize("sampling", [SamplingConfig(temp=0.0), SamplingConfig(temp=0.7),
                                      SamplingConfig(temp=1.3, top_p=0.8),
                                      SamplingConfig(temp=0.6, min_p=0.05, min_tokens_to_keep=3),
                                      SamplingConfig(temp=1.0, top_k=7)])
def test_probs_in_one_pass_are_the_exp_of_the_logprobs(sampling):
    """The prompt look's p (probs_from_logits, one softmax) is the distribution the rounds
    sample from (exp of logprobs_from_logits), filters included (tokens dropped: 0)."""
    logits = mx.random.normal((5, 300), key=mx.random.key(4)) * 3.0
    one_pass = np.array(probs_from_logits(logits, sampling))
    expected = np.exp(np.array(logprobs_from_logits(logits, sampling)))
    assert np.allclose(one_pass, expected, atol=1e-6) and np.allclose(one_pass.sum(-1), 1.0)
    assert ((one_pass == 0) == (expected == 0)).all()


def test_a_greedy_round_has_no_chances(target_model, drafts):
    assert all(r.chances is None for r in rounds(target_model, drafts["related"], 0.0, 3))


def test_the_first_chance_is_the_overlap_of_the_targets_and_the_drafts_distributions(
        target_model, drafts):
    """The first round's first chance, from p and q computed from scratch on the prompt."""
    draft, sampling = drafts["unrelated"], SamplingConfig(temp=0.8)
    first = rounds(target_model, draft, 0.8, 2, tokens=3)[0]
    ids = mx.array(PROMPT)[None]
    p = mx.exp(logprobs_from_logits(target_model(ids)[0, -1:], sampling))
    q = mx.exp(logprobs_from_logits(draft(ids)[0, -1:], sampling))
    assert len(first.chances) == first.num_drafted == 2
    assert first.chances[0] == pytest.approx(mx.minimum(p, q).sum().item(), abs=1e-4)


def test_an_identical_draft_is_kept_with_chance_one(target_model, drafts):
    chances = [c for r in rounds(target_model, drafts["identical"], 1.0, 3) for c in r.chances]
    assert chances and min(chances) > 0.999


def test_the_first_draft_is_kept_as_often_as_its_chance_says(target_model, drafts):
    """Over many rounds the first draft's keep rate and mean chance agree within 4 standard
    errors (a chance off by a position, or computed before the sampling transform, would not:
    the unrelated draft's chances average ~0.3)."""
    kept, chances = [], []
    for seed in range(8):
        for r in rounds(target_model, drafts["unrelated"], 1.0, 2, tokens=80, seed=seed):
            kept.append(r.num_accepted >= 1)
            chances.append(r.chances[0])
    n = len(kept)
    rate, mean = float(np.mean(kept)), float(np.mean(chances))
    assert n >= 150 and 0.05 < mean < 0.95
    assert abs(rate - mean) < 4 * np.sqrt(mean * (1 - mean) / n)


def test_expected_kept_counts_a_draft_only_if_those_before_it_were_kept():
    kept, rejected = expected_kept([0.5, 0.5, 1.0])
    assert kept == pytest.approx(0.5 + 0.25 + 0.25)
    assert rejected == pytest.approx(0.75)


def _one_round_estimates(chance, rng, soft):
    """Acceptance estimates after one k = 1 round of a source keeping drafts with `chance`,
    counted by the chances (`soft`, as the policy does) or by the flip."""
    estimate = SourceEstimate(k_max=8, acceptance=0.5, decay=0.9, free=False, block=False)
    kept = int(rng.random() < chance)
    estimate.count(*(expected_kept([chance]) if soft else (kept, float(not kept))))
    return estimate.acceptance


@pytest.mark.parametrize("soft", [True, False])
def test_one_round_tells_an_85_percent_source_from_a_50_percent_one(soft, monkeypatch):
    """With the chances, after one round each the 85% source is ahead every time; with the
    kept counts (the negative control) it is ahead only when its draft was kept and the
    other's rejected: 0.85 x 0.5, about 85 of the 200 trials."""
    rng = random.Random(0)
    ahead = sum(_one_round_estimates(0.85, rng, soft) > _one_round_estimates(0.5, rng, soft)
                for _ in range(200))
    if soft:
        assert ahead == 200
    else:
        assert ahead < 150


def test_the_policy_reads_a_rounds_chances(monkeypatch):
    """AdaptivePolicy.observe hands the round's chances to its source's estimate."""
    policy = policy_module.AdaptivePolicy(prior=None)
    policy.plain_trial = 0
    before = policy.source("draft").acceptance
    policy.observe(Round([0], 1, 0, "draft", None, [0.99]), 1.0)
    assert policy.source("draft").acceptance > before  # rejected, yet a 99% chance


def test_a_lookup_drafts_chance_is_the_targets_probability_of_it(target_model):
    """Prompt lookup proposes a point mass, so its first draft's chance is p(d1) itself."""
    sampling = SamplingConfig(temp=1.0)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9]  # "7 8 9" again: lookup proposes 10, 11, ...
    mx.random.seed(0)
    first = next(r for r in speculative_generate_step(
        prompt, target_model, None, max_tokens=4, sampling=sampling, prompt_lookup=True,
        num_draft_tokens=3) if r.num_drafted)
    p = mx.exp(logprobs_from_logits(target_model(mx.array(prompt)[None])[0, -1:], sampling))[0]
    assert first.source == "lookup" and len(first.chances) == first.num_drafted
    assert first.chances[0] == pytest.approx(p[10].item(), abs=1e-4)
