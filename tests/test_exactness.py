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
from mlx_spec.exactness import chi2_survival, check_exactness
from mlx_spec.sampling import SamplingConfig, logprobs_from_logits

PROMPT = [3, 1, 4]
SAMPLES = 3000
ALPHA = 1e-3

CONFIGS = {
    "temp=1": SamplingConfig(temp=1.0),
    "temp=0.7,top_p=0.9": SamplingConfig(temp=0.7, top_p=0.9),
    "temp=1,top_k=5": SamplingConfig(temp=1.0, top_k=5),
    "temp=1.3,min_p=0.05": SamplingConfig(temp=1.3, min_p=0.05),
}


@pytest.fixture(scope="module")
def poor_draft(drafts):
    return drafts["unrelated"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_matches_target(target_model, poor_draft, name):
    result = check_exactness(target_model, poor_draft, PROMPT, CONFIGS[name], samples=SAMPLES,
                             num_draft_tokens=2, alpha=ALPHA, seed=11)
    assert result.acceptance_rate < 0.5  # the draft really is poor
    assert result.passed, result


def test_prompt_lookup_sampling_matches_target(target_model):
    """A deterministic (one-hot q) proposal keeps the output exact too."""
    prompt = PROMPT + [9, 9, 3, 1, 4]  # the tail "3 1 4" recurs: lookup proposes "9 9 3"
    result = check_exactness(target_model, None, prompt, CONFIGS["temp=1"], samples=SAMPLES,
                             num_draft_tokens=3, alpha=ALPHA, prompt_lookup=True, seed=5)
    assert result.passed, result


def test_negative_control_broken_rule_is_caught(target_model, poor_draft):
    """Resampling rejections from p (not p - q) biases the output; the test must see it."""
    result = check_exactness(target_model, poor_draft, PROMPT, CONFIGS["temp=1"],
                             samples=SAMPLES, num_draft_tokens=2, alpha=ALPHA,
                             accept=resample_from_target_accept, seed=11)
    assert not result.passed, result


@pytest.mark.parametrize("x,dof", [(0.5, 1), (3.0, 2), (10.0, 5), (120.0, 100), (400.0, 300)])
def test_chi2_survival_matches_scipy(x, dof):
    assert chi2_survival(x, dof) == pytest.approx(stats.chi2.sf(x, dof), rel=1e-6, abs=1e-12)


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


def test_a_pair_the_target_never_produces_fails_the_check():
    from mlx_spec.exactness import chi_square

    exact = {(1, 2): 0.5, (1, 3): 0.5}
    statistic, _, p_value = chi_square({(1, 2): 40, (1, 3): 50, (1, 4): 1}, exact)
    assert p_value == 0.0 and statistic == float("inf")


@pytest.mark.parametrize("config", [
    SamplingConfig(temp=0.7), SamplingConfig(temp=1.0, top_k=5), SamplingConfig(temp=1.3, top_p=0.8),
    SamplingConfig(temp=1.0, min_p=0.05), SamplingConfig(temp=0.5, top_k=7, top_p=0.9)])
def test_logprobs_are_the_normalised_filtered_distribution(config):
    """Unfiltered rows skip the second normalisation: still log-probabilities summing to 1,
    equal to a softmax over the tokens the filters keep, computed here with numpy."""
    logits = mx.random.normal((3, 50), key=mx.random.key(1)) * 3
    got = np.exp(np.array(logprobs_from_logits(logits, config)))
    x = np.array(logits, dtype=np.float64) / config.temp
    def kept(p, keep):
        q = np.where(keep, p, 0)
        return q / q.sum()

    for row, want_row in zip(got, x):
        p = kept(np.exp(want_row - want_row.max()), True)
        keep = np.ones_like(p, dtype=bool)
        order = np.argsort(-p)
        if config.top_k:
            keep[order[config.top_k:]] = False
        if config.top_p < 1.0:
            mass = np.cumsum(kept(p, keep)[order])
            keep[order[np.searchsorted(mass, config.top_p) + 1:]] = False
        if config.min_p > 0.0:
            q = kept(p, keep)
            keep &= q >= q.max() * config.min_p
        np.testing.assert_allclose(row, kept(p, keep), atol=1e-5)
