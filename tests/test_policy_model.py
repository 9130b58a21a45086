"""The adaptive policy against the formula it states and the goal it serves.

The policy is one model (docs/drafting.md, "The policy"): rate_s(k) = E(a_s, k) / T_s(k) against
1 / t_plain. These tests check its choice against that formula computed here, and its speed on
simulated machines against the better of plain decoding and the best fixed k, bars fixed
before the first run (`test_policy.drive`: synthetic rounds on a fake clock, timed as the loop
times them, with what the loop measures before the first round handed in).
"""

import itertools

import pytest

from mlx_spec.costmodel import expected_tokens_per_round
from mlx_spec.loop import Round
from mlx_spec.policy import OFF_MARGIN, AdaptivePolicy, FixedPolicy
from test_policy import FakeClock, Timed, drive


def told_policy(plain=1.0, verify_per_token=0.1, step=0.2, acceptance=0.75):
    """A policy past its trial: plain steps timed at `plain`, the prefill and a draft step told."""
    policy = AdaptivePolicy(acceptance_prior=acceptance)
    policy.observe_prefill(100, 100 * verify_per_token)
    policy.observe_draft_step("draft", step)
    for i in range(4):
        policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), plain)
    return policy


@pytest.mark.parametrize("a,v,d", [(0.75, 0.1, 0.2), (0.9, 0.02, 0.05), (0.5, 0.5, 0.1),
                                   (0.95, 0.3, 0.01)])
def test_the_first_length_is_the_argmax_of_the_formula(a, v, d):
    """Before any round k* = argmax_k E(a, k) / (t_plain + k (v + d)), the prior's line; the
    cases include one where even k* loses (0.5, 0.5, 0.1: 0.94x plain)."""
    policy = told_policy(verify_per_token=v, step=d, acceptance=a)
    rates = {k: expected_tokens_per_round(a, k) / (1.0 + k * (v + d)) for k in range(1, 9)}
    best = max(rates, key=rates.get)
    assert policy.best("draft") == (best, pytest.approx(rates[best]))
    # it drafts its first round when that could pay for itself (_worth_exploring), else none
    assert policy.proposal_length("draft") == (best if rates[best] > 1.0 else 0)


def test_a_block_drafter_pays_one_step_whatever_k():
    """A block drafter's prior line: t_plain + k v + one step (its pass drafts the whole block)."""
    policy = AdaptivePolicy(block_tokens={"dflash": 16})
    policy.observe_prefill(100, 100 * 0.05)
    policy.observe_draft_step("dflash", 0.5)
    for i in range(4):
        policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), 1.0)
    a = policy.source("dflash").acceptance
    rates = {k: expected_tokens_per_round(a, k) / (1.5 + 0.05 * k) for k in range(1, 17)}
    assert policy.proposal_length("dflash") == max(rates, key=rates.get)


def test_rounds_move_the_line_off_the_prior():
    """Timed rounds at several k replace a wrong prior slope: told v = 0 while each drafted token
    really costs 0.5 of a plain step, the line learns the 0.5."""
    policy = told_policy(verify_per_token=0.0, step=0.0, acceptance=0.9)
    for i in range(60):
        k = 1 + i % 4
        policy.observe(Round([0] * (k + 1), k, k, "draft", None), 1.0 + 0.5 * k)
    estimate = policy.source("draft")
    line = policy._prior_line("draft", estimate)
    slope = estimate.seconds(5, line) - estimate.seconds(4, line)
    assert slope == pytest.approx(0.5, abs=0.05)


def test_a_losing_source_sits_out_and_plain_decoding_is_chosen():
    """Measured acceptance 0 on a machine where drafting costs: off, and plain steps run."""
    policy = told_policy(verify_per_token=0.3, step=0.2)
    for _ in range(3):
        k = policy.proposal_length("draft")
        if k:
            policy.observe(Round([0], k, 0, "draft", None), 1.0 + 0.5 * k)
    assert policy.proposal_length("draft") == 0 and policy.plain_steps() >= 16


def test_a_source_that_loses_with_every_draft_kept_never_drafts():
    """A draft whose step costs more than a plain step: no round, no probe, however long."""
    policy = told_policy(verify_per_token=0.1, step=1.2)
    asked = [policy.proposal_length("draft") for _ in range(5)]
    assert asked == [0] * 5 and policy.hopeless("draft")
    assert policy.source("draft").off_left >= 256


# The simulated machines: (verify cost per extra token, draft step), in plain steps; a round
# costs 1 + k (v + d), a plain step 1. Acceptance per draft: i.i.d.
MACHINES = {"gpu-like": (0.02, 0.05), "openblas-like": (0.15, 0.2), "netlib-like": (1.0, 0.2),
            "lookup-flat": (0.02, 0.0), "lookup-linear": (0.8, 0.0), "dear-draft": (0.1, 1.1)}
ACCEPTANCES = (0.0, 0.5, 0.8, 0.95)


def simulated_rate(policy, machine, a, tokens=800, seed=0):
    v, d = MACHINES[machine]
    clock = FakeClock()
    source = "lookup" if d == 0.0 else "draft"
    timed = Timed(policy, clock)
    timed.num_draft_tokens = lambda: timed.proposal_length(source)
    original = timed.observe
    timed.observe = lambda r: original(Round(r.tokens, r.num_drafted, r.num_accepted,
                                             source if r.num_drafted else "target", None))
    measured = (v, d) if d else None
    if measured is None and hasattr(policy, "observe_prefill"):  # a host search: the prefill
        policy.observe_prefill(100, 100 * v)
    rate, _ = drive(timed, clock, a, lambda k: 1.0 + k * (v + d), 1.0, tokens, seed=seed,
                    measured=measured)
    return rate


def best_fixed_rate(machine, a):
    """The better of plain decoding (1 token a step) and the best fixed k, in expectation."""
    v, d = MACHINES[machine]
    return max([1.0] + [expected_tokens_per_round(a, k) / (1.0 + k * (v + d))
                        for k in range(1, 33 if d == 0.0 else 9)])


@pytest.mark.parametrize("machine,a", list(itertools.product(MACHINES, ACCEPTANCES)))
def test_the_policy_comes_near_the_best_of_plain_and_every_fixed_k(machine, a):
    """Over 800 tokens the policy makes at least 0.9 of the better of plain decoding and the best
    fixed k (both in expectation), on every simulated machine and acceptance; where plain wins,
    at least 0.95 of plain. The bars were set before the first run."""
    rates = [simulated_rate(AdaptivePolicy(), machine, a, seed=seed) for seed in range(3)]
    got, best = sorted(rates)[1], best_fixed_rate(machine, a)
    assert got >= 0.9 * best, (got, best)
    if best == 1.0:
        assert got >= 0.95, got


def test_the_negative_control_a_fixed_k_fails_the_same_bar():
    """The bar can fail: k = 4 pinned on the netlib-like machine at acceptance 0.5."""
    got = simulated_rate(FixedPolicy(4), "netlib-like", 0.5)
    assert got < 0.9 * best_fixed_rate("netlib-like", 0.5)


def test_the_off_margin_is_the_documented_one():
    assert OFF_MARGIN == 0.05


def test_the_next_request_keeps_the_machine_and_forgets_the_text():
    """A server's next request (the batch engine's single-row policy): the plain step, the
    prefill's cost per token, the draft step and the cost line carry over; acceptance and off
    periods start afresh, and no plain trial is needed."""
    policy = told_policy(verify_per_token=0.3, step=0.2)
    for _ in range(6):
        k = policy.proposal_length("draft") or 1
        policy.observe(Round([0], k, 0, "draft", None), 1.0 + 0.5 * k)
    assert policy.source("draft").acceptance < 0.3
    fresh = policy.next_request()
    assert fresh.plain_seconds == policy.plain_seconds and fresh.plain_trial == 0
    assert (fresh.verify_per_token, fresh.step_seconds) == (0.3, {"draft": 0.2})
    assert fresh.source("draft").fit == policy.source("draft").fit
    assert fresh.source("draft").acceptance == pytest.approx(0.75)
    assert fresh.source("draft").off_left == 0 and fresh.switched_off == 0


def test_the_batch_engine_gives_each_request_alone_a_policy_of_its_own(target_model, drafts):
    from mlx_spec.batch.engine import BatchEngine
    from mlx_spec.batch.rows import RowRequest
    engine = BatchEngine(target_model, drafts["related"])
    seen = []
    for prompt in ([2, 7, 1, 8], [3, 1, 4, 1, 5]):
        engine.insert(RowRequest(prompt, max_tokens=6))
        while engine.busy:
            engine.step()
        seen.append(engine.single)
    assert seen[0] is not seen[1]


def test_a_match_that_holds_drafts_longer_than_one_acceptance_would():
    """Per-depth acceptance: a host search whose first draft is kept half the time but whose
    later drafts almost always are (a match holds or fails at its start) drafts longer than the
    pooled acceptance alone would have it, on a machine where verifying costs."""
    import random
    rng = random.Random(0)
    policy = told_policy(verify_per_token=0.2, step=0.0)
    for _ in range(60):
        k = max(policy.proposal_length("lookup"), 1)
        n = 0 if rng.random() < 0.5 else next((j for j in range(1, k) if rng.random() > 0.98), k)
        policy.observe(Round([0] * (n + 1), k, n, "lookup", None), 1.0 + 0.2 * k)
    estimate = policy.source("lookup")
    pooled = {k: expected_tokens_per_round(estimate.acceptance, k) / estimate.seconds(
        k, policy._prior_line("lookup", estimate)) for k in range(1, 33)}
    assert policy.best("lookup")[0] > max(pooled, key=pooled.get)
    first, second = estimate.expected_tokens(1) - 1, estimate.expected_tokens(2) - estimate.expected_tokens(1)
    assert first < 0.7 and second / first > 0.9  # a_1 about 0.5, a_2 near 1


def test_survivals_per_depth():
    from mlx_spec.policy import survivals
    assert survivals(4, 2) == [(1.0, 1.0), (1.0, 1.0), (1.0, 0.0), (0.0, 0.0)]
    assert survivals(2, 0, [0.5, 0.8]) == [(1.0, 0.5), (0.5, 0.4)]


def test_a_probe_whose_catch_up_costs_more_than_it_could_win_waits():
    """After an off period a draft model is fed every token it missed. Where that catch-up costs
    about a plain step a token (a quantized full-size copy on a CPU) and even at its prior the
    draft would hardly win, no probe; a cheap catch-up in front of a draft that could win is
    probed. (What a probe could save: PROBE_HORIZON tokens at the better of its estimate and
    its prior.)"""
    def after_an_off_period(step, catch_up, verify):
        policy = told_policy(verify_per_token=verify, step=step)
        policy.observe_catch_up("draft", 100, 100 * catch_up)
        policy.observe(Round([0], 1, 0, "draft", None), 1.0 + verify + step)  # a lost round
        estimate = policy.source("draft")
        estimate.switch_off()  # (as a verdict would)
        for _ in range(estimate.off_left):
            policy.observe(Round([0], 0, 0, "target", None), 1.0)
        return policy.proposal_length("draft")
    assert after_an_off_period(step=0.8, catch_up=0.8, verify=0.15) == 0
    assert after_an_off_period(step=0.1, catch_up=0.05, verify=0.15) > 0


def test_a_never_prefilled_draft_counts_its_prompt_in_its_first_rounds_cost():
    """A draft whose prompt waits (greedy) would pay for it in its first round: with a long
    prompt and a dear step the model does not explore it; with a short prompt it does."""
    def first(prompt_tokens):
        policy = AdaptivePolicy()
        policy.observe_prefill(prompt_tokens, prompt_tokens * 0.1)
        policy.observe_draft_step("draft", 0.3)  # its prompt: 0.03 a token
        for i in range(4):
            policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), 1.0)
        return policy.proposal_length("draft")
    assert first(5000) == 0  # 150 plain steps of prefill against at most 72 saved
    assert first(16) > 0


def test_a_short_reply_does_not_pay_for_a_first_round_a_long_one_would():
    """What a first round (or a probe) finds out pays only in the reply after it: the tokens a
    verdict decides about are the reply's tokens left (expect_reply), at most PROBE_HORIZON.
    The same draft, its prompt's catch-up about 3 plain steps, is explored with 500 tokens to
    go and not with 6; without a reply length PROBE_HORIZON stands, and each round counts
    against the reply."""
    def first(reply):
        policy = AdaptivePolicy()
        if reply is not None:
            policy.expect_reply(reply)
        policy.observe_prefill(100, 100 * 0.1)
        policy.observe_draft_step("draft", 0.3)
        for i in range(4):
            policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), 1.0)
        return policy, policy.proposal_length("draft")
    assert first(500)[1] > 0 and first(None)[1] > 0
    policy, k = first(10)
    assert k == 0 and policy.reply_left == 6 and policy.horizon() == 6


def test_the_loop_tells_the_policy_how_long_the_reply_may_be(model_dirs):
    from mlx_spec import load
    from mlx_spec.generate import speculative_generate_step

    target, _ = load(str(model_dirs["target"]))
    policy = AdaptivePolicy()
    told = []
    expect = policy.expect_reply
    policy.expect_reply = lambda tokens: (told.append(tokens), expect(tokens))
    tokens = sum(len(r.tokens) for r in speculative_generate_step(
        [5, 6, 7, 5, 6, 7, 5, 6], target, None, max_tokens=12, policy=policy,
        calibration=None))
    assert told == [12] and policy.reply_left == 12 - tokens


def test_timed_rounds_correct_the_prefills_verify_cost():
    """The prefill's per-token time is v's prior only: a host search's timed rounds (seconds
    less a plain step, per draft) replace it. Told 0.6 while a verified token costs a whole
    plain step (a quantized model on a CPU without BLAS), v moves to 1.0, and a server's next
    request starts from it; a stall counts as at most a plain step. A draft model's rounds
    leave it (its own line has its costs, a one-step timing may miss some)."""
    policy = told_policy(verify_per_token=0.6, step=0.2)
    assert policy.verify_seconds() == pytest.approx(0.6)
    policy.observe(Round([0, 0], 1, 1, "lookup", None), 30.0)  # a stall
    assert policy.verify_seconds() == pytest.approx(0.8)
    for _ in range(20):
        policy.observe(Round([0, 0, 0], 2, 2, "lookup", None), 3.0)
    assert policy.verify_seconds() == pytest.approx(1.0, abs=0.05)
    assert policy.next_request().verify_seconds() == pytest.approx(policy.verify_seconds())
    drafted = told_policy(verify_per_token=0.6, step=0.2)
    for _ in range(20):
        drafted.observe(Round([0, 0, 0], 2, 2, "draft", None), 1.0 + 2 * (1.0 + 0.2))
    assert drafted.verify_seconds() == pytest.approx(0.6)


def test_a_host_search_that_cannot_pay_is_not_probed():
    """Where a verified token costs a plain step, a host search's first round (its verdict)
    shows it: off, and no probe after the off period, since even at its prior acceptance it
    could not win. Where verifying is nearly free the same rounds are probed again."""
    def after_off_period(round_seconds):
        policy = told_policy(verify_per_token=0.6, step=0.0)
        k = policy.proposal_length("lookup")
        assert k >= 1  # the first round of a host search is its verdict
        policy.observe(Round([0], k, 0, "lookup", None), round_seconds(k))
        estimate = policy.source("lookup")
        if policy.proposal_length("lookup"):  # (one rejection does not switch a cheap one off)
            estimate.switch_off()
        for _ in range(estimate.off_left):
            policy.observe(Round([0], 0, 0, "target", None), 1.0)
        return policy.proposal_length("lookup"), estimate.off_left
    asked, off = after_off_period(lambda k: 1.0 + k)
    assert asked == 0 and off >= 256
    asked, _ = after_off_period(lambda k: 1.0 + 0.02 * k)
    assert asked > 0


def test_each_request_gives_a_host_search_its_verdict_round():
    """v carries to a server's next request, but a host search's first round in a request is
    its verdict whatever the last one measured (a stall there must not switch it off for good)."""
    policy = told_policy(verify_per_token=0.6, step=0.0)
    k = policy.proposal_length("lookup")
    policy.observe(Round([0], k, 0, "lookup", None), 1.0 + k)
    assert policy.proposal_length("lookup") == 0  # off after its verdict
    fresh = policy.next_request()
    assert fresh.verify_seconds() > 0.75 and fresh.proposal_length("lookup") >= 1


def test_a_fallback_is_asked_only_while_its_sources_sit_out():
    """policy.fall_back("lookup", ["draft"]): lookup proposes nothing while the draft is on; the
    round the draft goes off, one plain step, then lookup is asked (its own verdict and off
    switch); when the draft's probe is due, lookup stands aside again."""
    policy = told_policy(verify_per_token=0.1, step=0.2)
    policy.fall_back("lookup", ["draft"])
    assert policy.proposal_length("lookup") == 0 and policy.proposal_length("draft") > 0
    k = policy.proposal_length("draft")
    policy.observe(Round([0], k, 0, "draft", None), 1.0 + 0.3 * k)
    estimate = policy.source("draft")
    estimate.switch_off()  # (as its verdict would, after lookup was asked this round)
    assert policy.plain_steps() == 1
    assert policy.proposal_length("lookup") > 0 and policy.proposal_length("draft") == 0
    assert policy.plain_steps() > 1  # asked and no match: a block, not step by step
    policy.observe(Round([0], 0, 0, "target", None), 1.0)
    for _ in range(estimate.off_left):
        policy.observe(Round([0], 0, 0, "target", None), 1.0)
    assert estimate.off_left == 0 and policy.proposal_length("lookup") == 0


def _decisions(policy, rounds=300, seed=0):
    """Each round's best shapes of both sources, then its (draft k, lookup k, plain steps), on a
    fake machine: the draft's rounds keep a
    random number of drafts, or none in every other stretch of 80 rounds (it goes off, lookup
    and plain steps take over, its probes come back), lookup finds a match in half the rounds
    it is asked, and every round is timed as plain + k (v + d)."""
    import random

    rng = random.Random(seed)
    policy.observe_prefill(100, 10.0)
    policy.observe_draft_step("draft", 0.2)
    out = []
    for n in range(rounds):
        draft, lookup = policy.proposal_length("draft"), policy.proposal_length("lookup")
        out.append((policy.best_shape("draft"), policy.best_shape("lookup")))  # the figures too
        if draft:
            kept = rng.randint(0, draft) if (n // 80) % 2 == 0 else 0
            policy.observe(Round([0] * (kept + 1), draft, kept, "draft", None),
                           1.0 + 0.3 * draft + rng.random() * 0.1)
            out.append((draft, lookup, None))
        elif lookup and rng.random() < 0.5:
            kept = rng.randint(0, lookup)
            policy.observe(Round([0] * (kept + 1), lookup, kept, "lookup", None),
                           1.0 + 0.1 * lookup + rng.random() * 0.1)
            out.append((draft, lookup, None))
        else:
            steps = policy.plain_steps()
            out.append((draft, lookup, steps))
            for i in range(min(steps, 4)):
                policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0),
                               1.0 + rng.random() * 0.1)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kept_best_lengths_change_no_decision(seed, monkeypatch):
    """best() is kept per source until what it reads changes (a paid source's round leaves the
    others' standing): over rounds of a draft, lookup and plain steps, every decision equals
    that of a policy that works every one out afresh, and the kept ones saved work."""
    calls = {"n": 0}
    argmax = AdaptivePolicy._argmax

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return argmax(self, *args, **kwargs)

    monkeypatch.setattr(AdaptivePolicy, "_argmax", counted)
    kept = _decisions(AdaptivePolicy(), seed=seed)
    kept_calls, calls["n"] = calls["n"], 0
    monkeypatch.setattr(AdaptivePolicy, "best_shape",
                        lambda self, name, acceptance=None: self._argmax(name, acceptance))
    afresh = _decisions(AdaptivePolicy(), seed=seed)
    assert kept == afresh
    kept = [row for row in kept if len(row) == 3]
    assert sum(1 for d, _, _ in kept if d) > 20 and sum(1 for _, _, s in kept if s) > 5
    assert sum(1 for d, k, _ in kept if k and not d) > 20  # lookup asked alone
    assert kept_calls < 0.8 * calls["n"]


def test_a_machine_record_hands_each_call_the_machine_not_the_text(target_model, drafts,
                                                                   monkeypatch):
    """machine=MachineRecord(): a call's adaptive policy starts from what the last call's
    measured of the machine (its plain steps: no plain trial; the draft step and cost line)
    and from nothing of its text (the draft's acceptance is the prior again)."""
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.policy import TRIAL_STEPS, MachineRecord

    first_ask = {}
    proposal_length = AdaptivePolicy.proposal_length

    def spy(self, name):
        first_ask.setdefault(id(self), (self.plain_trial, self.source(name).acceptance))
        return proposal_length(self, name)

    monkeypatch.setattr(AdaptivePolicy, "proposal_length", spy)
    machine = MachineRecord()
    policies = []
    for prompt in ([2, 7, 1, 8, 2, 8], [3, 1, 4, 1, 5, 9]):
        list(speculative_generate_step(prompt, target_model, drafts["related"], max_tokens=16,
                                       calibration=None, machine=machine, prompt_lookup=False))
        policies.append(machine.policy)
    first, second = policies
    assert first is not second
    assert first_ask[id(first)][0] == TRIAL_STEPS and first_ask[id(second)][0] == 0
    assert second.plain_time[0] >= first.plain_time[0] > 0
    assert second.step_seconds.keys() == first.step_seconds.keys() == {"draft"}
    assert first_ask[id(second)][1] == pytest.approx(0.75)  # the prior, not the first's text
    with pytest.raises(ValueError, match="machine must be"):
        speculative_generate_step([1, 2], target_model, machine="no")


def test_the_one_at_a_time_engine_hands_the_machine_on():
    """The server's one-at-a-time engine gives each request's policy what the one before it
    measured of the machine (AdaptivePolicy.next_request), a row on its models' own cache
    kinds too (a quantized KV cache: batch/solo.py; the shipped pair)."""
    from mlx_spec.batch import BatchEngine
    from mlx_spec.batch.rows import RowRequest
    from mlx_spec import load_default_pair

    target, draft, tokenizer = load_default_pair()
    engine = BatchEngine(target, draft, max_rows=1, calibration=None, kv_bits=4,
                         kv_group_size=64)
    assert engine.solo
    seen = []
    for text in ("def add(a, b):", "class Point:"):
        engine.insert(RowRequest(tokenizer.encode(text), max_tokens=6))
        while engine.busy:
            engine.step()
        seen.append(engine.single)
    assert seen[0] is not None and seen[1] is not seen[0]
    assert seen[1].plain_time[0] >= seen[0].plain_time[0] > 0
