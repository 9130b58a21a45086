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
from mlx_spec.sampling import SamplingConfig, logprobs_from_logits, read_sampler

PROMPT = [3, 1, 4]
# 1,500 samples: the broken-rule control's chi-square has noncentrality ~125 on 59 dof here
# (0.083 a sample, from a 3,000-sample run): it passes (is missed) with probability ~3e-5;
# at seed 11 it fails at p ~ 1e-10. Each exact test fails falsely with probability ALPHA
# whatever the sample count.
SAMPLES = 1500
# The processors-blind-to-the-drafts control yields a pair the target never produces (t2 = t1
# under "no immediate repeat") in ~1% of samples (30 of 3,000): with 1,000 samples it is
# missed with probability ~0.99^1000 ~ 4e-5 (its first such pair at seed 7: sample 14).
PROCESSOR_SAMPLES = 1000
# The opaque sampler's exact run: 1,500 samples (p = 0.23 at its seed).
OPAQUE_SAMPLES = 1500
# The broken rule below measured p = 0.0 (rounded) from 600 samples on at this seed; it runs
# 800.
OPAQUE_CONTROL_SAMPLES = 800
ALPHA = 1e-3

# Unfiltered, and one filtered set (a temperature below 1 and top-p): the filters are one
# function (sampling.logprobs_from_logits) that makes p and q alike, checked against mlx-lm's
# own for eight parameter sets below (top-k and min-p among them); the speculative path never
# looks at which filter made a zero.
CONFIGS = {
    "temp=1": SamplingConfig(temp=1.0),
    "temp=0.7,top_p=0.9": SamplingConfig(temp=0.7, top_p=0.9),
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
    # The tail "3 1 4" recurs: lookup proposes what followed it, "7 29 ...", and the target's
    # p(7) there is 0.52, so about a quarter of the drafted tokens are accepted.
    prompt = PROMPT + [7, 29, 3, 1, 4]
    result = check_exactness(target_model, None, prompt, CONFIGS["temp=1"], samples=SAMPLES,
                             num_draft_tokens=3, alpha=ALPHA, prompt_lookup=True, seed=5)
    assert result.drafted >= SAMPLES, result  # lookup proposed in every sample's first round
    assert 0.1 < result.acceptance_rate < 0.9, result  # its proposals are kept, not always
    assert result.passed, result


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)],
                         ids=["exact-rule", "negative-control"])
def test_prompt_lookup_after_a_rejection_matches_target(accept, exact):
    """Lookup alone (as a target with no draft runs by default) on a model over 8 tokens whose
    prompt holds each of them, so that after a rejected first proposal the second token is a
    lookup proposal too, continuing the residual draw's latest occurrence. Resampling a
    rejection from p instead of p minus the one-hot q must fail the same test."""
    from tiny import make_llama

    target = make_llama(vocab_size=8, seed=0)
    # "3 1 4" recurs: lookup proposes "3 2" (p(3) = 0.66 there); a rejection draws mostly 0 or 2
    prompt = list(range(8)) + PROMPT + [3, 2] + PROMPT
    result = check_exactness(target, None, prompt, CONFIGS["temp=1"], samples=SAMPLES,
                             num_draft_tokens=3, alpha=ALPHA, prompt_lookup=True, seed=5,
                             accept=accept)
    first_rounds = 2 * SAMPLES  # two drafts each (the room left of max_tokens = 2)
    assert result.drafted - first_rounds > SAMPLES // 5, result  # second-token proposals
    assert result.passed == exact, result


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


def sampled_counts(logprobs, draws=3000, seed=0):
    """Counts of sampling.sample's draws, each row (a (2, V) input: both rows) per call."""
    from mlx_spec.sampling import sample
    mx.random.seed(seed)
    rows = mx.array(logprobs, mx.float32)
    counts = np.zeros(rows.shape, dtype=np.int64)
    for _ in range(draws):
        for row, token in enumerate(np.array(sample(rows, SamplingConfig(temp=1.0))).tolist()):
            counts[row, token] += 1
    return counts


def test_sample_draws_from_its_distribution_row_by_row():
    """The plain step's and the bonus token's draw (compiled with the global random state, as
    mlx-lm's sampler is): each row's draws match its own p; a seed repeats them."""
    rows = np.log(np.stack([P, Q]))
    counts = sampled_counts(rows)
    for row, p in zip(counts, (P, Q)):
        assert stats.chisquare(row, p * row.sum()).pvalue > ALPHA
    assert (sampled_counts(rows, draws=50, seed=3) == sampled_counts(rows, draws=50, seed=3)).all()
    assert (sampled_counts(rows, draws=50, seed=3) != sampled_counts(rows, draws=50, seed=4)).any()


def test_sample_negative_control_the_other_rows_p_is_caught():
    counts = sampled_counts(np.log(np.stack([P, Q])))
    assert stats.chisquare(counts[0], Q * counts[0].sum()).pvalue < ALPHA


def test_a_pair_the_target_never_produces_fails_the_check():
    from mlx_spec.exactness import chi_square

    exact = {(1, 2): 0.5, (1, 3): 0.5}
    statistic, _, p_value = chi_square({(1, 2): 40, (1, 3): 50, (1, 4): 1}, exact)
    assert p_value == 0.0 and statistic == float("inf")


FILTERED = [
    SamplingConfig(temp=0.7), SamplingConfig(temp=1.0, top_k=5), SamplingConfig(temp=1.3, top_p=0.8),
    SamplingConfig(temp=1.0, min_p=0.05), SamplingConfig(temp=0.5, top_k=7, top_p=0.9),
    SamplingConfig(temp=0.25, top_p=0.6), SamplingConfig(temp=2.0, min_p=0.2, min_tokens_to_keep=4),
    SamplingConfig(temp=0.8, top_p=0.7, min_p=0.1, top_k=3)]


def mlx_lm_distribution(logits, config):
    """What mlx-lm's make_sampler samples from, built from its own filter functions."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < config.top_p < 1:
        logprobs = apply_top_p(logprobs, config.top_p)
    if config.min_p:
        logprobs = apply_min_p(logprobs, config.min_p, config.min_tokens_to_keep)
    if config.top_k:
        logprobs = apply_top_k(logprobs, config.top_k)
    return np.array(mx.softmax(logprobs / config.temp, axis=-1))


@pytest.mark.parametrize("config", FILTERED)
def test_the_sampled_distribution_is_mlx_lms(config):
    """mlx-lm's order: filters on the untempered log-probabilities, then the temperature."""
    logits = mx.random.normal((3, 50), key=mx.random.key(1)) * 3
    got = np.exp(np.array(logprobs_from_logits(logits, config)))
    np.testing.assert_allclose(got, mlx_lm_distribution(logits, config), atol=1e-5)


def test_the_issue_example_samples_token_1_as_mlx_lm_does():
    """p = [.5, .3, .2], T = 0.25, top_p = 0.6: mlx-lm keeps tokens 0 and 1, token 1 with
    probability .3^4 / (.5^4 + .3^4) = 11.5%; filtering after the temperature kept token 0 only."""
    config = SamplingConfig(temp=0.25, top_p=0.6)
    got = np.exp(np.array(logprobs_from_logits(mx.log(mx.array([0.5, 0.3, 0.2])), config)))
    np.testing.assert_allclose(got, [0.5 ** 4 / (0.5 ** 4 + 0.3 ** 4), 0.3 ** 4 / (0.5 ** 4 + 0.3 ** 4), 0],
                               atol=1e-6)


@pytest.mark.parametrize("config", FILTERED)
def test_a_sampler_from_make_sampler_is_read_back(config):
    from mlx_lm.sample_utils import make_sampler
    made = make_sampler(temp=config.temp, top_p=config.top_p if config.top_p < 1 else 0.0,
                        min_p=config.min_p, min_tokens_to_keep=config.min_tokens_to_keep,
                        top_k=config.top_k)
    assert read_sampler(made) == config


def test_other_samplers_are_drawn_from_as_they_are():
    from mlx_lm.sample_utils import make_sampler
    assert read_sampler(make_sampler(0.0)).greedy
    xtc = make_sampler(temp=1.0, xtc_probability=0.5, xtc_threshold=0.1)
    for opaque in (xtc, lambda logprobs: mx.random.categorical(logprobs)):
        config = read_sampler(opaque)
        assert config.sampler is opaque and not config.greedy


def no_repeat(tokens, logits):
    """A logits processor that depends on the history: the last token may not come again."""
    return mx.where(mx.arange(logits.shape[-1]) == tokens[-1], -mx.inf, logits)


@pytest.mark.parametrize("name", ["no-repeat", "mlx-lm penalties"])
def test_logits_processors_keep_speculation_exact(target_model, poor_draft, name):
    """Every verified position gets the processors with the tokens before it, drafts included:
    the output is the processed distribution's (t2 sees t1, drafted or not)."""
    from mlx_lm.sample_utils import make_logits_processors
    processors = [no_repeat] if name == "no-repeat" else make_logits_processors(
        logit_bias={5: 2.0, 9: -1.0}, repetition_penalty=1.8, presence_penalty=0.5)
    result = check_exactness(target_model, poor_draft, PROMPT, CONFIGS["temp=1"],
                             samples=PROCESSOR_SAMPLES, num_draft_tokens=2, alpha=ALPHA, seed=7,
                             logits_processors=processors)
    assert 0 < result.acceptance_rate < 0.5
    assert result.passed, result


def test_negative_control_processors_blind_to_the_drafts_are_caught(target_model, poor_draft,
                                                                     monkeypatch):
    """Processors given the history without the drafts before each position (a plausible bug)
    let t2 repeat an accepted t1: the same test must fail."""
    import mlx_spec.loop as loop
    real = loop.processed
    monkeypatch.setattr(loop, "processed", lambda processors, seen, drafts, logits: real(
        processors, seen, drafts[:0], logits[:1]) * mx.ones((logits.shape[0], 1)))
    result = check_exactness(target_model, poor_draft, PROMPT, CONFIGS["temp=1"],
                             samples=PROCESSOR_SAMPLES, num_draft_tokens=2, alpha=ALPHA, seed=7,
                             logits_processors=[no_repeat])
    assert not result.passed, result


def _opaque_run(target_model, poor_draft, accept=None, samples=OPAQUE_SAMPLES):
    """A sampler mlx-spec cannot read, whose distribution the test knows (T = 0.8), with a
    processor that makes each position depend on the one before."""
    from mlx_spec.exactness import chi_square, exact_distribution, sample_first_two
    opaque = SamplingConfig(temp=1.0, sampler=lambda logprobs: mx.random.categorical(logprobs / 0.8))
    mx.random.seed(3)
    counts, acceptance = sample_first_two(target_model, poor_draft, PROMPT, opaque, samples,
                                          num_draft_tokens=2, accept=accept,
                                          logits_processors=[no_repeat])
    exact = exact_distribution(target_model, PROMPT, SamplingConfig(temp=0.8),
                               logits_processors=[no_repeat])
    return chi_square(counts, exact)[2], acceptance


def test_an_opaque_sampler_is_exact_by_matching_its_draws(target_model, poor_draft):
    p_value, acceptance = _opaque_run(target_model, poor_draft)
    assert 0 < acceptance < 0.5
    assert p_value > ALPHA


def test_negative_control_matching_draws_from_the_wrong_position_is_caught(target_model, poor_draft):
    """Every position drawn from the first position's log-probabilities (a plausible bug)."""
    from mlx_spec.acceptance import sampler_match
    sampler = lambda logprobs: mx.random.categorical(logprobs / 0.8)  # noqa: E731
    rule = sampler_match(sampler)
    broken = lambda tokens, probs, logprobs: rule(  # noqa: E731
        tokens, probs, mx.broadcast_to(logprobs[:1], logprobs.shape))
    p_value, _ = _opaque_run(target_model, poor_draft, accept=broken,
                             samples=OPAQUE_CONTROL_SAMPLES)
    assert p_value < ALPHA


# --- after a mid-generation rejection: tokens 3 and 4 at T = 1 ---
#
# The chi-square tests above look at the first two tokens, which the first round (from the
# prefilled prompt) and at most one rewind produce. Here the caches are rewound after a
# rejected draft *before* position 3 in most samples, and the verify pass that makes tokens
# 3 and 4 reads the rewound cache. With 8 tokens the target's exact distribution of
# (t3, t4) is a sum over all 8^2 prefixes (t1, t2): nothing is approximated.

SMALL_VOCAB = 8
MID_PROMPT = [3, 1, 4]
MID_SAMPLES = 800  # seeds 0-2: the exact rule passes at p > 0.4, the control fails at p < 1e-8


@pytest.fixture(scope="module")
def small_pair():
    """A target with an 8-token vocabulary, and an unrelated draft of the same vocabulary
    made as conftest's `unrelated` draft is (seed 7, hidden 32, one layer)."""
    from tiny import make_llama
    return (make_llama(vocab_size=SMALL_VOCAB, seed=0),
            make_llama(vocab_size=SMALL_VOCAB, seed=7, hidden=32, layers=1))


def exact_third_and_fourth(target_model, prompt, sampling):
    """{(t3, t4): probability} under the target alone, enumerating every t1 t2 t3."""
    joint = {(): 1.0}
    for _ in range(4):
        prefixes = list(joint)
        logits = target_model(mx.array([prompt + list(p) for p in prefixes]))[:, -1]
        p = np.array(mx.exp(logprobs_from_logits(logits, sampling)), np.float64)
        joint = {prefix + (t,): joint[prefix] * p[row, t]
                 for row, prefix in enumerate(prefixes) for t in range(p.shape[1])}
    exact = {}
    for tokens, prob in joint.items():
        exact[tokens[2:]] = exact.get(tokens[2:], 0.0) + prob
    return exact


def sample_third_and_fourth(target_model, draft_model, prompt, sampling, samples, k, accept=None):
    """Counts of (t3, t4) over `samples` speculative generations of 4 tokens; how many of
    them rejected a draft in a round that ended before position 3; drafted and accepted."""
    from mlx_spec.cache import ModelCache, make_cache
    from mlx_spec.cache.prefill import prefill
    from mlx_spec.generate import speculative_generate_step

    target_cache, draft_cache = make_cache(target_model), make_cache(draft_model)
    caches = [ModelCache(target_model, target_cache), ModelCache(draft_model, draft_cache)]
    for cache in caches:
        prefill(cache, prompt[:-1], 512)
    prefilled = [cache.checkpoint() for cache in caches]
    counts, rewound, drafted, accepted = {}, 0, 0, 0
    for _ in range(samples):
        out, early_rejection = [], False
        for round_ in speculative_generate_step(
                prompt[-1:], target_model, draft_model, max_tokens=4, num_draft_tokens=k,
                sampling=sampling, accept=accept, prompt_cache=target_cache + draft_cache,
                calibration=None):
            if round_.num_accepted < round_.num_drafted and len(out) + len(round_.tokens) < 3:
                early_rejection = True  # tokens 3 and 4 come from a rewound cache
            drafted += round_.num_drafted
            accepted += round_.num_accepted
            out += round_.tokens
            if len(out) >= 4:
                break
        rewound += early_rejection
        counts[(out[2], out[3])] = counts.get((out[2], out[3]), 0) + 1
        for cache, point in zip(caches, prefilled):
            cache.restore(point)
    return counts, rewound, drafted, accepted


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)],
                         ids=["exact-rule", "negative-control"])
def test_tokens_after_a_mid_generation_rejection_match_target(small_pair, accept, exact):
    """Chi-square of (t3, t4) at T = 1, k = 2, with a poor draft: most samples rejected a
    draft and rewound before token 3. Resampling rejections from p (not p - q) must fail."""
    from mlx_spec.exactness import chi_square

    target_model, draft_model = small_pair
    sampling = CONFIGS["temp=1"]
    mx.random.seed(0)
    counts, rewound, drafted, accepted = sample_third_and_fourth(
        target_model, draft_model, MID_PROMPT, sampling, MID_SAMPLES, k=2, accept=accept)
    assert sum(counts.values()) == MID_SAMPLES
    assert rewound > MID_SAMPLES // 2, rewound  # the rewind really is mid-generation
    assert 0 < accepted < drafted / 2, (accepted, drafted)  # the draft is poor, not useless
    statistic, dof, p_value = chi_square(counts, exact_third_and_fourth(
        target_model, MID_PROMPT, sampling))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)
