"""Statistical exactness at temperature > 0.

Sample the first two generated tokens thousands of times with speculation and
a deliberately poor draft, and compare with the target's exact distribution
(chi-square). The negative control -- resampling a rejection from p instead of
the residual p - q -- must fail the very same test.
"""

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mlx_spec.acceptance import resample_from_target_accept, speculative_accept
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig, logprobs_from_logits

PROMPT = [3, 1, 4]
SAMPLES = 3000
ALPHA = 1e-3


def exact_two_token_distribution(target_model, sampling):
    """P(t1, t2) under the target alone, from its processed distributions."""
    logits = target_model(mx.array([PROMPT]))[0, -1]
    p1 = np.array(mx.exp(logprobs_from_logits(logits, sampling)))
    vocab = p1.shape[0]
    support = np.nonzero(p1 > 0)[0]
    batch = mx.array([PROMPT + [int(t)] for t in support])
    p2 = np.zeros((vocab, vocab))
    p2[support] = np.array(mx.exp(logprobs_from_logits(target_model(batch)[:, -1], sampling)))
    return p1[:, None] * p2  # (V, V)


def sample_two_tokens(target_model, draft_model, sampling, accept, k, seed):
    mx.random.seed(seed)
    counts = {}
    for _ in range(SAMPLES):
        out = []
        for round_ in speculative_generate_step(PROMPT, target_model, draft_model,
                                                max_tokens=3, num_draft_tokens=k,
                                                sampling=sampling, accept=accept):
            out += round_.tokens
            if len(out) >= 2:
                break
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_pvalue(counts, exact):
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled)."""
    n = sum(counts.values())
    expected = exact.ravel() * n
    observed = np.zeros_like(expected)
    vocab = exact.shape[0]
    for (a, b), c in counts.items():
        observed[a * vocab + b] += c
    assert observed[expected == 0].sum() == 0, "sampled a token the target forbids"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


CONFIGS = {
    "temp=1": SamplingConfig(temp=1.0),
    "temp=0.7,top_p=0.9": SamplingConfig(temp=0.7, top_p=0.9),
    "temp=1,top_k=5": SamplingConfig(temp=1.0, top_k=5),
}


@pytest.fixture(scope="module")
def poor_draft(drafts):
    return drafts["unrelated"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_matches_target(target_model, poor_draft, name):
    sampling = CONFIGS[name]
    exact = exact_two_token_distribution(target_model, sampling)
    counts = sample_two_tokens(target_model, poor_draft, sampling, None, k=2, seed=11)
    assert chi_square_pvalue(counts, exact) > ALPHA


def test_prompt_lookup_sampling_matches_target(target_model):
    """A deterministic (one-hot q) proposal keeps the output exact too."""
    sampling = SamplingConfig(temp=1.0)
    exact = exact_two_token_distribution(target_model, sampling)
    counts = {}
    mx.random.seed(5)
    prompt = PROMPT + [9, 9, 3, 1, 4]  # the tail "3 1 4" recurs: lookup proposes "9 9 3"
    exact = exact_two_token_distribution_for(target_model, sampling, prompt)
    for _ in range(SAMPLES):
        out = []
        for round_ in speculative_generate_step(prompt, target_model, None, max_tokens=3,
                                                num_draft_tokens=3, sampling=sampling,
                                                prompt_lookup=True):
            out += round_.tokens
            if len(out) >= 2:
                break
        counts[(out[0], out[1])] = counts.get((out[0], out[1]), 0) + 1
    assert chi_square_pvalue(counts, exact) > ALPHA


def exact_two_token_distribution_for(target_model, sampling, prompt):
    global PROMPT
    saved, PROMPT = PROMPT, prompt
    try:
        return exact_two_token_distribution(target_model, sampling)
    finally:
        PROMPT = saved


def test_negative_control_broken_rule_is_caught(target_model, poor_draft):
    """Resampling rejections from p (not p - q) biases the output; the test must see it."""
    sampling = CONFIGS["temp=1"]
    exact = exact_two_token_distribution(target_model, sampling)
    counts = sample_two_tokens(target_model, poor_draft, sampling,
                               resample_from_target_accept, k=2, seed=11)
    assert chi_square_pvalue(counts, exact) < ALPHA


# --- the rule alone, with hand-made p and q: many samples, very sharp test ---

P = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
Q = np.array([0.05, 0.1, 0.15, 0.2, 0.5])  # deliberately poor: mass where p has little


def first_token_counts(rule, q_rows, draws=6000, seed=0):
    """Emitted first token over many applications of `rule` with k = 1."""
    mx.random.seed(seed)
    target_logprobs = mx.log(mx.array(np.stack([P, P]), mx.float32))  # (k+1, V)
    draft_probs = mx.array(q_rows[None], mx.float32)  # (1, V)
    counts = np.zeros(len(P))
    draft_tokens = np.random.default_rng(seed).choice(len(P), size=draws, p=q_rows)
    for x in draft_tokens:
        n, token = rule(mx.array([int(x)], mx.uint32), draft_probs, target_logprobs)
        counts[x if n.item() == 1 else token.item()] += 1
    return counts


@pytest.mark.parametrize("q_name,q", [("poor", Q), ("one-hot", np.eye(5)[3])])
def test_rule_alone_is_exact(q_name, q):
    counts = first_token_counts(speculative_accept, q)
    assert stats.chisquare(counts, P / P.sum() * counts.sum()).pvalue > ALPHA


def test_rule_alone_negative_control():
    counts = first_token_counts(resample_from_target_accept, Q)
    assert stats.chisquare(counts, P / P.sum() * counts.sum()).pvalue < ALPHA
