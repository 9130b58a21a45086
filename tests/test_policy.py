"""Draft-length policies, driven by synthetic rounds on a fake clock (timed as the loop times them)."""

import random

import pytest

from mlx_spec.generate import speculative_generate_step
from mlx_spec.loop import Round, RoundClock
from mlx_spec.costmodel import CostPrior
from mlx_spec.policy import (TRIAL_STEPS, AdaptivePolicy,
                             FixedPolicy, make_policy)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Timed:
    """A policy asked and told as the loop does it: the loop's RoundClock on `clock`, started
    at the first question, one lap per observed round."""

    def __init__(self, policy, clock):
        self.policy = policy
        self.round_clock = RoundClock(clock)

    def proposal_length(self, source):
        self.round_clock.start()
        return self.policy.proposal_length(source)

    def num_draft_tokens(self):
        return self.proposal_length("draft")

    def plain_steps(self):
        self.round_clock.start()
        return self.policy.plain_steps()

    def observe(self, round_):
        self.policy.observe(round_, self.round_clock.lap())

    def __getattr__(self, name):
        return getattr(self.policy, name)


def drive(policy, clock, acceptance, round_cost, plain_step, tokens, seed=0, noise=0.0,
          measured=None):
    """Drive a policy through synthetic rounds.

    acceptance: a per-draft probability, or a function of the tokens emitted so far;
    round_cost(k): seconds of a round drafting k; noise: +-fraction on every timing.
    Returns tokens per simulated second (after the first round) and the positions
    of the tokens that were decoded plainly. `measured`: (seconds per prefill token, seconds
    of a draft step), handed to the policy before the first round as the loop does.
    """
    rng = random.Random(seed)
    if measured is not None and hasattr(policy, "observe_prefill"):
        policy.observe_prefill(100, 100 * measured[0])
        policy.observe_draft_step("draft", measured[1])
    emitted, start, plain_at = 0, None, []
    while emitted < tokens:
        k = policy.num_draft_tokens()
        scale = rng.uniform(1 - noise, 1 + noise) if noise else 1.0
        if k == 0:
            clock.now += plain_step * scale
            policy.observe(Round([0], 0, 0, "target", None))
            plain_at.append(emitted)
            emitted += 1
        else:
            a = acceptance(emitted) if callable(acceptance) else acceptance
            n = 0
            while n < k and rng.random() < a:
                n += 1
            clock.now += round_cost(k) * scale
            policy.observe(Round([0] * (n + 1), k, n, "draft", None))
            emitted += n + 1
        if start is None:
            start = clock.now
    return emitted / (clock.now - start), plain_at


def simulate(policy, clock, acceptance, draft_step, verify, plain_step, tokens=600, seed=0):
    """Tokens per simulated second; a round costs k draft steps plus verifying k + 1 tokens."""
    return drive(policy, clock, acceptance, lambda k: k * draft_step + verify(k + 1),
                 plain_step, tokens, seed)[0]


def test_the_first_plain_block_is_timed_from_when_it_was_asked_for():
    """A pipelined block: the first step carries the next one's dispatch, the last (nothing
    queued after it) is nearly free. Timed from the first answer, the trial read 0.7 of a
    step and a draft that wins at k = 1 looked like one that loses."""
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    clock.now = 5.0  # the prefill
    n = policy.plain_steps()
    assert n == TRIAL_STEPS
    for seconds in [1.8] + [1.0] * (n - 2) + [0.2]:  # n steps of 1.0 s in all
        clock.now += seconds
        policy.observe(Round([0], 0, 0, "target", None))
    assert policy.measured_plain_seconds == pytest.approx(1.0, rel=0.1)


def test_flat_verify_cost_and_good_draft_drafts_long():
    """GPU-like: verifying 9 tokens costs about one step, the draft is cheap."""
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    rate = simulate(policy, clock, acceptance=0.85, draft_step=0.05,
                    verify=lambda t: 1.0 + 0.02 * t, plain_step=1.0)
    assert policy.switched_off == 0
    assert policy.k >= 4
    assert rate > 2.0  # tokens per plain-step time: speculation pays


def test_linear_verify_cost_switches_speculation_off():
    """Reference-BLAS-like: verifying T tokens costs T steps, so drafting cannot pay."""
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    rate = simulate(policy, clock, acceptance=0.6, draft_step=0.2,
                    verify=lambda t: 1.0 * t, plain_step=1.0, tokens=1500)
    assert policy.switched_off >= 1
    assert rate > 0.95  # the goal: within 5% of plain decoding


def test_poor_draft_switches_off_and_probes_again():
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    simulate(policy, clock, acceptance=0.05, draft_step=0.1,
             verify=lambda t: 1.0 + 0.05 * t, plain_step=1.0, tokens=2000)
    assert policy.switched_off >= 2  # probed again after an off period, lost again


def _drafted_rounds(acceptance, verify, draft_step=0.2, tokens=2000, measured=None):
    """How many speculative rounds a simulated run of `tokens` drafted."""
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    drafted = []
    original = policy.observe
    policy.observe = lambda round_: (drafted.append(round_.num_drafted), original(round_))
    drive(policy, clock, acceptance, lambda k: k * draft_step + verify(k + 1), 1.0, tokens,
          measured=measured)
    return sum(k > 0 for k in drafted), policy


def test_a_machine_where_verifying_is_dear_stops_probing():
    """Losing on cost (once the cost line is measured, it would lose even with every draft
    kept) is not a hard stretch of text: no probe can change it, so after a few rounds the
    draft is never probed again; losing on acceptance (verifying is nearly free) keeps being
    probed after each off period, within the probe budget."""
    dear, policy = _drafted_rounds(0.6, verify=lambda t: 1.0 * t)
    assert dear <= 20  # (uninformed: its prior line guessed; the rounds teach it)
    cheap, _ = _drafted_rounds(0.0, verify=lambda t: 1.0 + 0.02 * t)
    assert cheap > dear
    # Told what the loop measures before the first round (a prefill token costs a plain step,
    # a draft step 0.2 of one), the model knows at once: no round at all.
    told, _ = _drafted_rounds(0.6, verify=lambda t: 1.0 * t, measured=(1.0, 0.2))
    assert told == 0


def test_adaptive_k_beats_a_poor_fixed_k_in_simulation():
    results = {}
    for name, make in {"adaptive": lambda c: Timed(AdaptivePolicy(), c),
                       "fixed-1": lambda c: Timed(FixedPolicy(1), c)}.items():
        clock = FakeClock()
        results[name] = simulate(make(clock), clock, acceptance=0.9, draft_step=0.03,
                                 verify=lambda t: 1.0 + 0.02 * t, plain_step=1.0)
    assert results["adaptive"] > results["fixed-1"]


def test_make_policy():
    assert isinstance(make_policy(3), FixedPolicy)
    assert isinstance(make_policy(None, adaptive=True), AdaptivePolicy)
    with pytest.raises(ValueError):  # the API checks num_draft_tokens where it enters
        FixedPolicy(0)


@pytest.mark.parametrize("draft_name", ["identical", "related", "unrelated"])
def test_adaptive_policy_keeps_greedy_parity(target_model, drafts, draft_name):
    def run(**kwargs):
        out = []
        for r in speculative_generate_step([2, 7, 1, 8], target_model, max_tokens=80, **kwargs):
            out += r.tokens
        return out[:80]

    assert run(draft_model=drafts[draft_name], adaptive=True) == run()


def test_confidence_stop_keeps_greedy_parity(target_model, drafts):
    def run(**kwargs):
        out, ks = [], []
        for r in speculative_generate_step([2, 7, 1, 8], target_model, max_tokens=50, **kwargs):
            out += r.tokens
            ks.append(r.num_drafted)
        return out[:50], ks

    plain, _ = run()
    got, ks = run(draft_model=drafts["related"], num_draft_tokens=6, draft_confidence=0.5,
                  prompt_lookup=False)
    assert got == plain
    assert min(k for k in ks if k) < 6  # the stop did cut some drafts short



def test_flat_noisy_round_times_keep_speculation_on():
    """A GPU-like flat verify cost with noise (fitted slopes <= 0) must not make a
    plain step look cheaper than a round and switch a 6x-winning speculation off."""
    rng = random.Random(0)
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    for step in range(300):
        k = policy.num_draft_tokens()
        if k == 0:  # an uncalibrated policy times plain steps first (its first look aside)
            assert step <= TRIAL_STEPS
            clock.now += 0.050
            policy.observe(Round([0], 0, 0, "target", None))
            continue
        assert k > 0, "speculation was switched off"
        n = 0
        while n < k and rng.random() < 0.94:
            n += 1
        clock.now += 0.050 + 0.0005 * k + rng.uniform(-0.002, 0.002)
        policy.observe(Round([0] * (n + 1), k, n, "draft", None))
    assert policy.switched_off == 0


def hard_opening_plain_steps(seed, opening=12, tokens=240):
    """Plain steps taken after a hard opening, in a simulated run where speculation wins."""
    clock = FakeClock()
    _, plain_at = drive(Timed(AdaptivePolicy(), clock), clock,
                        acceptance=lambda emitted: 0.05 if emitted < opening else 0.75,
                        round_cost=lambda k: 0.15 * k + 1.0 + 0.1 * (k + 1), plain_step=1.0,
                        tokens=tokens, seed=seed, noise=0.2)  # +-20%, as on a shared machine
    return sum(position >= opening for position in plain_at)


def test_hard_opening_does_not_keep_a_winning_draft_switched_off():
    """The draft misses nearly everything for 12 tokens (a docstring, say), then the text is easy.

    On the easy text speculation wins (about 1.4x plain), so the probes after an off period
    must be able to outvote the bad start: the acceptance memory ages with the tokens decoded
    without the draft, and a probe drafts PROBE_ROUNDS rounds before the next verdict (one
    k = 1 round is a coin flip). Two failed probes in a row can still (rightly) switch it off
    for longer, so the test looks at the spread over 100 runs.
    """
    plain = sorted(hard_opening_plain_steps(seed) for seed in range(100))
    assert plain[50] <= 32, plain  # median: at most one off period after the opening
    assert plain[90] <= 96, plain  # 90th percentile: at most two


def test_lookup_proposals_grow_past_the_draft_cap_when_verifying_is_cheap():
    """Lookup drafts for free: with a flat verify cost and a copy, its k goes past 8."""
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    rng = random.Random(0)
    for _ in range(60):
        k = policy.proposal_length("lookup")
        n = 0
        while n < k and rng.random() < 0.97:
            n += 1
        clock.now += 1.0 + 0.02 * (k + 1)
        policy.observe(Round([0] * (n + 1), k, n, "lookup", None))
    assert policy.source("lookup").k > 8
    assert policy.source("draft").rounds == 0  # the draft model's estimate was not touched


def test_sources_keep_their_own_acceptance():
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(), clock)
    for _ in range(20):
        clock.now += 1.0
        policy.observe(Round([0], 4, 0, "lookup", None))  # lookup: every draft rejected
        clock.now += 1.0
        policy.observe(Round([0] * 5, 4, 4, "draft", None))  # draft: all accepted
    assert policy.source("lookup").acceptance < 0.1
    assert policy.source("draft").acceptance > 0.9


def _prior(draft_step, verify, plain=1.0, acceptance=None):
    return CostPrior(plain, {t: verify(t) for t in (1, 2, 4, 8, 16, 32)},
                     {"lookup": 0.0, "draft": draft_step},
                     {"draft": acceptance} if acceptance is not None else {})


def test_a_calibration_that_says_drafting_loses_starts_plain():
    """Reference-BLAS-like costs: the calibration alone switches the draft off from token one."""
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(prior=_prior(0.3, lambda t: 1.0 * t, acceptance=0.5)), clock)
    assert policy.num_draft_tokens() == 0
    assert policy.plain_steps() >= 16
    rate = simulate(policy, clock, acceptance=0.5, draft_step=0.3, verify=lambda t: 1.0 * t,
                    plain_step=1.0, tokens=600)
    cold_clock = FakeClock()
    cold = simulate(Timed(AdaptivePolicy(), cold_clock), cold_clock, acceptance=0.5, draft_step=0.3,
                    verify=lambda t: 1.0 * t, plain_step=1.0, tokens=600)
    assert rate > 0.95 and rate >= cold


def test_a_calibration_that_says_drafting_wins_starts_at_its_best_k():
    clock = FakeClock()
    policy = Timed(AdaptivePolicy(prior=_prior(0.05, lambda t: 1.0 + 0.02 * t,
                                                   acceptance=0.9)), clock)
    first = policy.num_draft_tokens()
    assert first >= 6  # no cold k, k/2, 3k/2 schedule: straight to a long k
    assert policy.describe()["calibrated"] is True


def test_the_loop_tells_the_policy_what_a_draft_catch_up_costs(target_model, drafts):
    """The draft model's prompt prefill is timed and handed to the policy (per token), which
    counts it in a probe's cost after an off period; a short prompt's is not (fixed costs).
    (At T > 0 the prompt look reads its prefill: it runs before the first round.)"""
    from mlx_spec.sampling import SamplingConfig

    def told(prompt):
        policy = AdaptivePolicy()
        for _ in speculative_generate_step(prompt, target_model, drafts["related"], max_tokens=4,
                                           policy=policy, prompt_lookup=False,
                                           sampling=SamplingConfig(temp=0.7)):
            pass
        return policy.catch_up_seconds
    assert told(list(range(2, 40)))["draft"] > 0
    assert "draft" not in told([2, 7, 1, 8])


def test_greedy_a_draft_is_prefilled_only_when_the_policy_first_asks(target_model, drafts,
                                                                      monkeypatch):
    """Greedy, the draft model's prompt waits for the policy's first request: a draft whose
    timed step costs more than a target step (hopeless: it would lose with every draft kept)
    is never prefilled at all, and one that drafts is prefilled once, after the trial; the
    text is the target's alone either way."""
    from mlx_spec.drafters.draft_model import DraftModelDrafter
    prefilled = []
    original = DraftModelDrafter.prefill
    monkeypatch.setattr(DraftModelDrafter, "prefill", lambda self, tokens, *a, **k: (
        prefilled.append(len(tokens)), original(self, tokens, *a, **k))[1])
    prompt = list(range(2, 40))
    plain = [t for r in speculative_generate_step(prompt, target_model, max_tokens=24,
                                                  prompt_lookup=False) for t in r.tokens]

    def run(step):
        monkeypatch.setattr(AdaptivePolicy, "observe_draft_step",
                            lambda self, source, seconds: self.step_seconds.update({source: step}))
        prefilled.clear()
        return [t for r in speculative_generate_step(prompt, target_model, drafts["identical"],
                                                     max_tokens=24, prompt_lookup=False)
                for t in r.tokens]
    assert run(10.0) == plain and prefilled == []
    assert run(1e-9) == plain and len(prefilled) == 1 and prefilled[0] > len(prompt)


def test_the_loop_times_one_draft_step_for_a_cold_start_only(target_model, drafts):
    """With no calibration the draft model's step is timed once after its prefill and handed to
    the policy (its cost line's prior), and so is the target's prefill; with a calibration the
    draft step is not."""
    def told(prior=None):
        policy = AdaptivePolicy(prior=prior)
        for _ in speculative_generate_step(list(range(2, 40)), target_model, drafts["related"],
                                           max_tokens=4, policy=policy, prompt_lookup=False):
            pass
        return policy
    cold = told()
    assert cold.step_seconds["draft"] > 0 and cold.verify_per_token > 0
    assert told(_prior(0.05, lambda t: 1.0 + 0.02 * t, acceptance=0.9)).step_seconds == {}


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_timing_a_draft_step_leaves_the_draft_as_it_was(family):
    """The timed step is undone (attention trimmed, recurrent state put back, a sliding window
    rewound): the proposals after it equal those of a drafter that was never timed."""
    from families import make_family
    from tiny import make_llama
    from mlx_spec.drafters import DraftModelDrafter
    from mlx_spec.sampling import SamplingConfig
    draft = make_llama(seed=3) if family == "llama" else make_family(family, seed=3)
    prompt = list(range(3, 30))
    proposals = []
    for timed in (False, True):
        drafter = DraftModelDrafter(draft, SamplingConfig(), 64)
        drafter.prefill(prompt, 512)
        if timed:
            assert drafter.step_seconds(prompt[-1]) > 0
        proposals.append(drafter.propose(prompt + [5], 4).tokens.tolist())
    assert proposals[0] == proposals[1]


def test_a_look_after_a_round_takes_the_guess_s_place():
    """SourceEstimate.reprior: a prior put in place after rounds leaves the counts that prior
    would have given after the same rounds. (After an off period the two differ a little: how
    much `forget` ages the counts depends on the acceptance they give.)"""
    from mlx_spec.policy import SourceEstimate

    def after(prior, look=None):
        estimate = SourceEstimate(8, prior, 0.9, False, False)
        estimate.count(1.0, 1.0)
        estimate.count(2.0, 0.0)
        if look is not None:
            estimate.reprior(look)
        return estimate.accepted, estimate.rejected

    assert after(0.5, look=0.8) == pytest.approx(after(0.8))
    assert after(0.5, look=0.8) != pytest.approx(after(0.5))


def test_a_prompt_look_after_the_first_round_still_counts():
    """A request whose policy learnt the machine drafts at once (no plain trial); the look,
    after its first round, still replaces the guessed prior (it was dropped before)."""
    policy = AdaptivePolicy(8)
    policy.observe_prefill(64, 0.64)
    for _ in range(8):
        policy.observe(Round([0], 0, 0, "target", None), 0.01)
    policy.observe(Round([0, 0], 2, 1, "draft", None, [0.6, 0.4]), 0.02)
    assert policy.still_looks("draft") or policy.hopeless("draft")
    before = policy.source("draft").acceptance
    policy.observe_prompt_look("draft", 0.95, 32)
    assert policy.source("draft").looked and policy.source("draft").acceptance > before + 0.1


@pytest.mark.parametrize("look, tried", [(None, True), (0.12, False), (0.9, True)])
def test_a_first_round_is_tried_at_the_better_of_the_estimate_and_the_look(look, tried):
    """A paid source's first round must pay for itself at the better of its estimate and its
    prior; the prompt look, where there is one, is that prior: a look that found the draft weak
    is no reason to try it, where the guessed sampling prior (0.5) would have been. The costs
    are a random draft's at T = 1 (bench/zoo.py's weak pair, OpenBLAS): a step at 0.13 of a
    plain step, a verified token at 0.17."""
    policy = AdaptivePolicy(8, acceptance_prior=0.5)
    policy.observe_prefill(31, 31 * 0.0032)
    policy.observe_draft_step("draft", 0.0024)
    policy.expect_reply(96)
    for _ in range(TRIAL_STEPS):
        policy.observe(Round([0], 0, 0, "target", None), 0.0187)
    if look is not None:
        policy.observe_prompt_look("draft", look, 8)
    assert (policy.proposal_length("draft") > 0) == tried
    assert (policy.source("draft").off_left > 0) == (not tried)
