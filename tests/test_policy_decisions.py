"""The policy's and prompt lookup's decisions on synthetic round streams (issue 29).

Each test drives the object the loop drives, as the loop drives it (policy:
proposal_length, plain_steps, observe with the round's seconds; lookup:
lookup, then commit with the accepted count), with scripted outcomes, and
checks one decision: a source that always fails is switched off, a perfect one
is driven to its largest k, a lookup alignment that failed twice proposes short
and earns its length back.
"""

import itertools
import random

import pytest

from mlx_spec.drafters import PromptLookupDrafter
from mlx_spec.drafters.prompt_lookup import SHORT_LOOKUP_TOKENS
from mlx_spec.loop import Round
from mlx_spec import policy as policy_module
from mlx_spec.policy import PLAIN_TRIAL_STEPS, PROBE_BUDGET, AdaptivePolicy, greedy_look_ceiling
from mlx_spec.prompt_look import GREEDY_ROWS

PLAIN_STEP = 1.0  # seconds


def cpu_round(k):
    """OpenBLAS-like: verifying k + 1 tokens costs a step plus a tenth of one per draft."""
    return PLAIN_STEP + 0.1 * k


def run_stream(policy, source, accepted_of, rounds, round_seconds=cpu_round, offs=None):
    """Feed `rounds` rounds (plain steps when the policy proposes nothing); each round of k
    drafts accepts accepted_of(k). Returns the k asked for at each round (0: a plain block);
    `offs`, when given, gets the policy's switch-off count as each round was asked."""
    asked = []
    for _ in range(rounds):
        k = policy.proposal_length(source)
        asked.append(k)
        if offs is not None:
            offs.append(policy.switched_off)
        if k == 0:
            for _ in range(policy.plain_steps()):
                policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
            continue
        n = accepted_of(k)
        policy.observe(Round([0] * (n + 1), k, n, source, None), round_seconds(k))
    return asked


def speculative_rounds_before_off(asked, offs):
    """How many rounds drafted before the source was first switched off."""
    return sum(1 for k, off in zip(asked, offs) if k > 0 and off == 0)


@pytest.mark.parametrize("source,slope,within", [
    ("draft", 0.1, 20), ("draft", 0.5, 4), ("draft", 1.0, 3),
    ("lookup", 0.1, 20), ("lookup", 0.5, 4), ("lookup", 1.0, 3)])
def test_a_source_that_always_fails_is_switched_off_within_n_rounds(source, slope, within):
    """N shrinks as each failed round costs more: a round of k drafts costs 1 + slope * k plain
    steps, and every draft is rejected. At slope 0.1 (a failed k = 1 round loses 9%) the
    prior acceptance (0.75, decaying 0.9 per round) takes 18 rounds to fall far enough;
    at 1.0 a draft model is off after its three first rounds (the first look, the catch-up
    round, not timed, and k = 3, which gives the cost a slope) and lookup, a host search
    that drafts during the trial, after its two first rounds and one at k = 1 once the
    trial has timed plain steps (it drafted before them); at 0.5 one round more, since a loss
    of 5-15% must be seen in two verdicts in a row (policy.CLEAR_LOSS)."""
    policy, offs = AdaptivePolicy(), []
    asked = run_stream(policy, source, lambda k: 0, rounds=within + 8,
                       round_seconds=lambda k: PLAIN_STEP + slope * k, offs=offs)
    assert policy.plain_trial == 0  # the cold start's plain steps were timed
    assert policy.switched_off >= 1
    assert speculative_rounds_before_off(asked, offs) <= within, asked


@pytest.mark.parametrize("source,largest", [("draft", 8), ("lookup", 32)])
def test_a_perfect_source_is_driven_to_its_largest_k(source, largest):
    policy = AdaptivePolicy()
    asked = run_stream(policy, source, lambda k: k, rounds=40)
    assert policy.switched_off == 0
    assert policy.source(source).best_k() == largest
    assert largest in asked[-6:], asked  # explore rounds aside, it drafts the largest k


def test_the_cold_start_times_plain_steps_first():
    policy = AdaptivePolicy()
    assert policy.proposal_length("draft") == 0
    assert policy.plain_steps() == policy_module.FIRST_LOOK_AFTER  # then its first look
    policy = AdaptivePolicy()
    policy.proposal_length("lookup")
    assert policy.plain_steps() == PLAIN_TRIAL_STEPS  # while lookup finds no match


def test_a_paid_source_looks_once_inside_the_trial():
    """After the step that carries the prefill a draft model drafts one round (k = 1), still in
    step with the prompt (lookup, asked first, waits for it), then the trial's other steps
    are timed at once, for the first look's verdict; lookup waits for them too."""
    policy = AdaptivePolicy()
    policy.proposal_length("lookup")
    assert policy.proposal_length("draft") == 0
    assert policy.plain_steps() == policy_module.FIRST_LOOK_AFTER
    policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
    assert policy.proposal_length("lookup") == 0
    assert policy.proposal_length("draft") == 1
    policy.observe(Round([0, 0], 1, 1, "draft", None), cpu_round(1))
    assert policy.proposal_length("lookup") == 0
    assert policy.proposal_length("draft") == 0
    assert policy.plain_steps() == PLAIN_TRIAL_STEPS - policy_module.FIRST_LOOK_AFTER
    for _ in range(policy.plain_steps()):
        policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
    assert policy.proposal_length("lookup") == 2  # a quarter of its first 8


def test_lookup_drafts_during_the_trial_when_it_has_a_match(monkeypatch):
    """A copy task's answer matches the prompt from its first token: lookup proposes at once
    instead of waiting out four plain steps (a tenth of a 96-token copy). Negative control:
    the trial first (LOOKUP_IN_TRIAL off)."""
    assert AdaptivePolicy().proposal_length("lookup") == 2
    monkeypatch.setattr(policy_module, "LOOKUP_IN_TRIAL", False)
    assert AdaptivePolicy().proposal_length("lookup") == 0


def test_a_draft_as_costly_as_its_target_is_off_after_its_first_look(monkeypatch):
    """A draft step costs more than a plain step (an 8-bit copy of a float32 target on a CPU,
    whose quantized products are slower than OpenBLAS's: the hybrid pair's first look took 4
    plain steps), so no acceptance can win: judged against the trial's plain steps, its
    first look is hopeless and it never drafts again in 96 tokens, nor pays to catch up on
    the trial's tokens. Negative control: the whole trial first, then a catch-up round and
    a timed one."""
    costly = lambda k: 1.0 + 2.5 * k  # noqa: E731 (k draft steps + verifying k + 1)

    def drafted_rounds():
        asked = drafts_with_catch_up(AdaptivePolicy(), lambda k: k, 96, costly, catch_up=1.0)
        return sum(1 for k in asked if k > 0)
    assert drafted_rounds() == 1
    monkeypatch.setattr(policy_module, "FIRST_LOOK", False)
    assert drafted_rounds() >= 2


def test_the_first_rounds_rule_left_off_ends_a_costly_first_look(monkeypatch):
    """The rule tried and left off (policy.FIRST_ROUNDS_OPTIMISTIC): at T > 0 a k = 1 round
    costing two plain steps (an MTP head on a CPU's fast float32 target) is predicted 20%
    slower than plain even at the better of its acceptance and its 0.5 prior, so with the rule
    an accepted first look (0.61 estimated, above HOPELESS) is the only round; as shipped
    the source drafts its three first rounds (a strong draft's first look costs the same)."""
    costly = lambda k: 1.0 + 1.0 * k  # noqa: E731 (k = 1: two plain steps)

    def drafted_rounds():
        policy = AdaptivePolicy(acceptance_prior=0.5)  # T > 0
        asked = drafts_with_catch_up(policy, lambda k: min(k, 1), 96, costly, catch_up=0.0)
        return sum(1 for k in asked if k > 0)
    assert drafted_rounds() >= 3
    monkeypatch.setattr(policy_module, "FIRST_ROUNDS_OPTIMISTIC", True)
    assert drafted_rounds() == 1


@pytest.mark.parametrize("prior,seconds", [(0.75, lambda k: 1.0 + 1.0 * k),  # T = 0, costly
                                           (0.5, lambda k: 1.1 + 0.1 * k)])  # T > 0, cheap
def test_with_that_rule_a_rejected_first_look_that_could_win_goes_on(prior, seconds, monkeypatch):
    """That rule is about cost, not luck: a rejected first look keeps its first rounds when at
    its prior it could still win (greedy, prior 0.75, at two plain steps a round; a cheap
    draft at T > 0)."""
    monkeypatch.setattr(policy_module, "FIRST_ROUNDS_OPTIMISTIC", True)
    policy = AdaptivePolicy(acceptance_prior=prior)
    asked = drafts_with_catch_up(policy, lambda k: 0 if k == 1 else k, 24, seconds, catch_up=0.0)
    assert sum(1 for k in asked if k > 0) >= 2


def drafts_with_catch_up(policy, accepted_of, tokens, steady, catch_up, first_plain=PLAIN_STEP,
                         chances_of=None, spent=None):
    """A draft model's rounds as the loop sees them: a round of k costs steady(k), plus
    `catch_up` seconds when the draft missed more than one token since its last round (its
    first round after the cold start's trial, or after an off period); the first plain step
    takes `first_plain`. `chances_of(k)`, when given, gives the round's chances (T > 0) and
    `accepted_of(chances)` the kept count; `spent`, a list, gets every round's seconds.
    Returns the k asked per round (0: a plain block)."""
    spent = [] if spent is None else spent
    asked, emitted, missed = [], 0, 0
    while emitted < tokens:
        k = policy.proposal_length("draft")
        asked.append(k)
        if k == 0:
            steps = policy.plain_steps()
            for _ in range(steps):
                spent.append(first_plain if emitted == 0 else PLAIN_STEP)
                policy.observe(Round([0], 0, 0, "target", None), spent[-1])
                emitted += 1
            missed += steps
            continue
        chances = chances_of(k) if chances_of else None
        n = accepted_of(chances if chances_of else k)
        seconds = steady(k) + (catch_up if missed > 1 else 0.0)
        spent.append(seconds)
        policy.observe(Round([0] * (n + 1), k, n, "draft", None, chances), seconds)
        emitted, missed = emitted + n + 1, 0
    return asked


def switched_off_runs(accept_rate, steady, catch_up=0.0, tokens=96, seeds=30):
    """In how many of `seeds` runs (each draft accepted with probability accept_rate) the
    policy switched the draft off at least once."""
    runs = 0
    for seed in range(seeds):
        rng = random.Random(seed)

        def accepted_of(k):
            n = 0
            while n < k and rng.random() < accept_rate:
                n += 1
            return n
        policy = AdaptivePolicy(acceptance_prior=0.5)  # T > 0
        drafts_with_catch_up(policy, accepted_of, tokens, steady, catch_up)
        runs += policy.switched_off > 0
    return runs


def test_a_draft_models_catch_up_round_does_not_switch_a_winner_off(monkeypatch):
    """Steady rounds win (~1.3x at k = 4, 88% acceptance), but the first round after the
    cold start's trial also feeds the draft the trial's tokens, a step more. Fitted, that
    round steepened the slope from the first rounds until the source lost its verdict (the
    strong pair at T = 1: docs/benchmarks.md). Negative control: the same runs with that
    round fitted."""
    steady = lambda k: 1.37 + 0.3 * k  # noqa: E731 (the strong pair's, in plain steps)
    assert switched_off_runs(0.88, steady, catch_up=1.0) <= 2
    monkeypatch.setattr(policy_module, "UNTIMED_CATCH_UP", False)
    assert switched_off_runs(0.88, steady, catch_up=1.0) >= 4


def sampled_stream(rng, accept_rate, spread):
    """(chances_of(k), accepted_of(chances)) of a run at T > 0: each draft's chance of being kept
    drawn around `accept_rate` (+- spread), the rule's coin flipped with it."""
    def chances_of(k):
        return [min(1.0, max(0.0, accept_rate + rng.uniform(-spread, spread))) for _ in range(k)]

    def accepted_of(chances):
        n = 0
        while n < len(chances) and rng.random() < chances[n]:
            n += 1
        return n
    return chances_of, accepted_of


def sampled_runs(accept_rate, steady, tokens=96, seeds=100, spread=0.3):
    """(runs switched off at least once, tokens per plain step) over `seeds` runs at
    T > 0, each draft's chance of being kept drawn around `accept_rate` (+- spread) and the
    rule's coin flipped with it; every round hands the policy its chances."""
    runs, emitted, seconds = 0, 0, 0.0
    for seed in range(seeds):
        chances_of, accepted_of = sampled_stream(random.Random(seed), accept_rate, spread)
        spent = []
        policy = AdaptivePolicy(acceptance_prior=0.5)
        drafts_with_catch_up(policy, accepted_of, tokens, steady, 0.0, chances_of=chances_of,
                             spent=spent)
        runs += policy.switched_off > 0
        emitted += tokens
        seconds += sum(spent)
    return runs, emitted * PLAIN_STEP / seconds


def test_a_sampled_winner_is_judged_by_its_chances_not_its_coin_flips(monkeypatch):
    """A draft kept half the time at T > 0 wins (~1.1x plain at these costs), but a few
    rejected rounds in a row make the kept counts predict a loss: with them (SOFT_ACCEPTANCE
    off, the negative control) it was switched off in about a third of the runs; with each
    round's chances, in none, and the runs decode faster."""
    steady = lambda k: 1.1 + 0.25 * k  # noqa: E731
    soft_offs, soft_rate = sampled_runs(0.5, steady)
    monkeypatch.setattr(policy_module, "SOFT_ACCEPTANCE", False)
    count_offs, count_rate = sampled_runs(0.5, steady)
    assert soft_offs <= 2 and count_offs >= 15
    assert soft_rate > count_rate


def test_one_unlucky_verdict_does_not_switch_a_marginal_winner_off(monkeypatch):
    """A source winning ~10% at T > 0 loses a verdict now and then on one rejected round;
    predicted 5-15% slower it is switched off only when two verdicts in a row say so.
    Negative control: every verdict final (CLEAR_LOSS = OFF_MARGIN)."""
    steady = lambda k: 1.3 + 0.15 * k  # noqa: E731
    kept = switched_off_runs(0.65, steady)
    monkeypatch.setattr(policy_module, "CLEAR_LOSS", policy_module.OFF_MARGIN)
    assert kept + 3 <= switched_off_runs(0.65, steady)


def probe_spells(budget, monkeypatch):
    monkeypatch.setattr(policy_module, "PROBE_BUDGET", budget)
    policy = AdaptivePolicy()
    asked = drafts_with_catch_up(policy, lambda k: 0, 200, steady=lambda k: 1.0 + 0.5 * k,
                                 catch_up=0.5)
    return policy, sum(1 for before, k in zip(asked, asked[1:]) if before == 0 and k > 0)


def test_a_source_that_keeps_losing_is_not_probed_past_the_budget(monkeypatch):
    """After its first off period it is probed once more; later probes wait until the net
    loss of speculation is under PROBE_BUDGET of the time decoded. Negative control: with
    no budget it is probed after every off period."""
    policy, spells = probe_spells(PROBE_BUDGET, monkeypatch)
    assert spells == 3  # the first look, the first rounds after the trial, one probe in 200
    assert policy.lost <= PROBE_BUDGET * policy.elapsed + 3.0  # + the first verdict's rounds
    _, unlimited = probe_spells(float("inf"), monkeypatch)
    assert unlimited >= 4


# --- prompt lookup: the match's track record sizes its proposal ---

SOURCE = list(range(100, 160))  # a prompt of 60 distinct tokens
# The answer copies the prompt with two substitutions in a row (900, 901), then exactly.
PROMPT = SOURCE + SOURCE[:4]
TRUTH = SOURCE[4:10] + [900] + SOURCE[11:12] + [901] + SOURCE[13:]


def copy_rounds(drafter, k=16):
    """Rounds of a scripted target that emits TRUTH: (proposed, accepted) per lookup round;
    a step with no proposal is a plain step, as in the loop."""
    history, rounds = list(PROMPT), []
    while len(history) - len(PROMPT) < len(TRUTH) - 1:
        truth = TRUTH[len(history) - len(PROMPT):]
        found = drafter.lookup(history, min(k, len(truth) - 1))
        if not found:
            history.append(truth[0])
            continue
        n = 0
        while n < len(found) and found[n] == truth[n]:
            n += 1
        drafter.commit(n)
        rounds.append((len(found), n))
        history += truth[:n + 1]
    return rounds


def test_a_lookup_alignment_that_failed_twice_proposes_short_then_grows_back():
    rounds = copy_rounds(PromptLookupDrafter(1000, greedy=True))
    # two proposals along the same alignment cut short by the edits (900, then 901)
    assert [n < proposed for proposed, n in rounds[:2]] == [True, True]
    assert rounds[2] == (SHORT_LOOKUP_TOKENS, SHORT_LOOKUP_TOKENS)  # short, and accepted
    lengths = [proposed for proposed, _ in rounds[2:]]
    assert lengths[:4] == [2, 4, 8, 16]  # doubling with each full acceptance, up to k
    assert all(n == proposed for proposed, n in rounds[2:])


def test_without_the_track_record_the_same_stream_keeps_proposing_k():
    """The negative control: the old drafter's third proposal is as long as k."""
    PromptLookupDrafter.track_record = False
    try:
        rounds = copy_rounds(PromptLookupDrafter(1000, greedy=True))
    finally:
        PromptLookupDrafter.track_record = True
    assert rounds[2][0] == 16


def test_a_fresh_one_token_match_is_not_a_lottery_ticket():
    """A one-token match proposes 2 tokens, not k; a long backward match earns k."""
    drafter = PromptLookupDrafter(1000, greedy=True)
    assert len(drafter.lookup([5, 1, 2, 3, 4, 9, 8, 7, 6, 5], 16)) == 2
    long_match = PromptLookupDrafter(1000, greedy=True)
    assert len(long_match.lookup(SOURCE + SOURCE[:10], 16)) == 16


def test_a_calibration_does_not_switch_lookup_off_before_its_first_round(monkeypatch):
    """A netlib-like calibration (verifying T tokens costs T steps) measured on ordinary text
    (acceptance 0.3) says both sources lose. The draft model starts off; prompt lookup, whose
    acceptance is the text's (a copy accepts ~90%), drafts and is judged on its own rounds.
    Negative control: the calibration's verdict for lookup too."""
    from mlx_spec.costmodel import CostPrior
    prior = CostPrior(1.0, {t: float(t) for t in (1, 2, 4, 8, 16, 32)},
                      {"draft": 0.3, "lookup": 0.0}, {"draft": 0.3, "lookup": 0.3})
    policy = AdaptivePolicy(prior=prior)
    assert policy.proposal_length("draft") == 0
    assert policy.proposal_length("lookup") > 0
    monkeypatch.setattr(policy_module, "CALIBRATION_JUDGES_LOOKUP", True)
    assert AdaptivePolicy(prior=prior).proposal_length("lookup") == 0


def test_a_block_drafters_first_rounds_are_sized_from_the_default_k(monkeypatch):
    """A block of 16 may draft up to 15, but its first rounds draft a quarter, a quarter and
    three quarters of the default k (1, 1, 3), not of 15 (3, 3, 11: a verify of 12 tokens,
    ~4.5 plain steps on this CPU). Negative control: sized from the block."""
    def first_rounds():
        policy = AdaptivePolicy(block_tokens={"dflash": 15})
        policy.proposal_length("dflash")
        policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)  # the prefill's step
        asked = []
        while len(asked) < 3:
            k = policy.proposal_length("dflash")
            if k == 0:
                for _ in range(policy.plain_steps()):
                    policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
                continue
            asked.append(k)
            policy.observe(Round([0] * (k + 1), k, k, "dflash", None), PLAIN_STEP + 0.05 * k)
        return asked, policy.source("dflash").k_max
    assert first_rounds() == ([1, 1, 3], 15)
    monkeypatch.setattr(policy_module, "BLOCK_FIRST_FROM_BLOCK", True)
    assert first_rounds() == ([3, 3, 11], 15)


def costly_draft_run(catch_up_per_token, tokens=384):
    """The sliding-window pair on a CPU: a quantized draft whose round costs 3.4 plain steps
    (hopeless), and whose catch-up over a backlog costs `catch_up_per_token` plain steps a
    token, as its timed prompt prefill of 23 tokens told the policy. Returns (drafted
    spells, plain blocks, seconds spent catching up)."""
    policy = AdaptivePolicy(acceptance_prior=0.5)
    policy.observe_catch_up("draft", 23, 23 * catch_up_per_token)
    asked, emitted, missed, caught_up = [], 0, 0, 0.0
    while emitted < tokens:
        k = policy.proposal_length("draft")
        asked.append(k)
        if k == 0:
            steps = min(policy.plain_steps(), tokens - emitted)
            for _ in range(steps):
                policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
            emitted, missed = emitted + steps, missed + steps
            continue
        catch_up = catch_up_per_token * missed if missed > 1 else 0.0
        caught_up += catch_up
        policy.observe(Round([0, 0], k, 1, "draft", None), 1.4 + 2.0 * k + catch_up)
        emitted, missed = emitted + 2, 0
    spells = sum(1 for before, k in zip([0] + asked, asked) if before == 0 and k > 0)
    return spells, asked.count(0), caught_up


def test_a_probe_whose_catch_up_would_not_fit_the_budget_waits(monkeypatch):
    """The sliding pair's defaults ran at 0.85x plain over 384 tokens: its first probe, after
    a long off period, fed the draft 128 tokens (55 plain steps). Counted in the probe budget,
    that catch-up never fits: one spell (the first look), no catch-up, and the plain steps in
    long blocks (each block's end costs a fraction of a step). A catch-up a GPU's prefill makes
    nearly free leaves the probe to the budget as before. Negative control: the catch-up left
    out of the budget."""
    spells, blocks, caught_up = costly_draft_run(catch_up_per_token=0.44)
    assert (spells, caught_up) == (1, 0.0)
    assert blocks <= 6  # the trial's, then off periods of 128 and 256 (not 16-token waits)
    assert costly_draft_run(catch_up_per_token=0.001)[0] >= 2
    monkeypatch.setattr(policy_module, "CATCH_UP_IN_BUDGET", False)
    spells, _, caught_up = costly_draft_run(catch_up_per_token=0.44)
    assert spells >= 2 and caught_up > 50


NETLIB_PLAIN = 5.47e-3  # a netlib calibration of the skip-f32 pair: verify(t) grows with t
NETLIB_VERIFY = {1: 9.96e-3, 2: 12.9e-3, 3: 15.6e-3, 4: 17.6e-3, 5: 20.2e-3, 6: 23.3e-3,
                 8: 29.4e-3, 10: 36.2e-3, 12: 42.4e-3, 16: 54.9e-3, 24: 81.7e-3, 32: 108e-3}


def calibrated_lookup_run(failed_first, verify=NETLIB_VERIFY, tokens=96):
    """Calibrated lookup on a copy: its first `failed_first` rounds keep nothing, then every
    proposal is kept. Returns (tokens lookup emitted, times switched off)."""
    from mlx_spec.costmodel import CostPrior
    prior = CostPrior(NETLIB_PLAIN, verify, {"lookup": 0.0, "suffix": 0.0})
    policy = AdaptivePolicy(prior=prior)
    emitted = by_lookup = rounds = 0
    while emitted < tokens:
        k = policy.proposal_length("lookup")
        if k == 0:
            steps = policy.plain_steps()
            for _ in range(steps):
                policy.observe(Round([0], 0, 0, "target", None), NETLIB_PLAIN)
            emitted += steps
            continue
        kept = 0 if rounds < failed_first else k
        rounds += 1
        seconds = verify[min(verify, key=lambda t: abs(t - (k + 1)))]
        policy.observe(Round([0] * (kept + 1), k, kept, "lookup", None), seconds)
        emitted, by_lookup = emitted + kept + 1, by_lookup + kept + 1
    return by_lookup, policy.switched_off


def test_a_failed_first_lookup_round_does_not_end_a_copy(monkeypatch):
    """A match holds or fails as a whole: after one failed first round and two kept whole, the
    per-draft estimate (0.77) predicted 0.82x plain on a netlib calibration and switched lookup
    off for the rest of the copy (before MATCH_TIME_DOUBLES, whose longer second round now
    lifts that estimate; two failed first rounds still sink it). No verdict on a round kept
    whole: lookup emits most of the reply. Negative control: the verdict on every round
    (MATCH_HOLDS off)."""
    assert calibrated_lookup_run(failed_first=1)[0] >= 70
    assert calibrated_lookup_run(failed_first=2)[0] >= 70
    monkeypatch.setattr(policy_module, "MATCH_HOLDS", False)
    assert calibrated_lookup_run(failed_first=2)[0] <= 10
    monkeypatch.setattr(policy_module, "MATCH_TIME_DOUBLES", False)
    assert calibrated_lookup_run(failed_first=1)[0] <= 10


def copy_lookup_lengths(rounds=8, plain_after=None, source="lookup",
                        verify=lambda k: 13.5e-3 + 3.9e-3 * k):
    """Uncalibrated lookup on a float16 copy on a CPU (a plain step of 15.7 ms; verifying k + 1
    tokens 13.5 ms + 3.9 ms a draft), every proposal kept whole: the lengths it
    proposes. `plain_after`: one plain step after that many rounds (the match was lost)."""
    policy, lengths = AdaptivePolicy(), []
    while len(lengths) < rounds:
        k = policy.proposal_length(source)
        if k == 0 or len(lengths) == plain_after:
            policy.observe(Round([0], 0, 0, "target", None), 15.7e-3)
            plain_after = None if k else plain_after
            continue
        lengths.append(k)
        policy.observe(Round([0] * (k + 1), k, k, source, None), verify(k))
    return lengths


def test_a_lookup_proposal_kept_whole_is_followed_by_one_twice_as_long(monkeypatch):
    """MATCH_DOUBLES: a copy kept whole doubles its proposal up to the cap (32), where the
    per-draft model alone grows it a few tokens a round (here 2, 6, 6, 9, 11, 17, ...). After
    a plain step (the match lost) the next length is the model's again. Negative control: the
    model alone takes longer to reach the cap."""
    lengths = copy_lookup_lengths()
    assert all(b >= min(2 * a, 32) for a, b in zip(lengths, lengths[1:]))
    assert lengths[-1] == 32 and lengths.index(32) <= 5
    broken = copy_lookup_lengths(plain_after=4)
    assert broken[4] < min(2 * broken[3], 32)
    monkeypatch.setattr(policy_module, "MATCH_DOUBLES", False)
    model = copy_lookup_lengths()
    assert 32 not in model[:6] and sum(model) < sum(lengths)


def test_where_a_verify_is_nearly_flat_a_match_kept_whole_goes_to_the_cap_sooner(monkeypatch):
    """MATCH_TIME_DOUBLES: "twice as long" is counted in verify time. Where verifying k + 1
    tokens costs 15 ms + 0.3 ms a draft (float32 with OpenBLAS, a GPU), the round after the
    first kept whole proposes the cap; where a draft costs 3.9 ms (float16 on a CPU) the
    lengths are about the doubling's. Negative control: twice the tokens (the flag off)."""
    flat = copy_lookup_lengths(verify=lambda k: 15e-3 + 0.3e-3 * k)
    assert flat.index(32) == 2
    assert all(b >= min(2 * a, 32) for a, b in zip(flat, flat[1:]))
    linear = copy_lookup_lengths()
    monkeypatch.setattr(policy_module, "MATCH_TIME_DOUBLES", False)
    assert copy_lookup_lengths(verify=lambda k: 15e-3 + 0.3e-3 * k).index(32) == 3
    tokens_doubled = copy_lookup_lengths()
    assert all(abs(a - b) <= max(a, b) // 2 for a, b in zip(linear, tokens_doubled))


def test_suffix_drafting_doubles_a_match_kept_whole_as_lookup_does():
    """Both host searches (policy.FREE_SOURCES) share the rule: the same stream drafted by
    suffix drafting proposes the same lengths."""
    assert copy_lookup_lengths(source="suffix") == copy_lookup_lengths()


def test_a_lookup_that_cannot_win_even_kept_whole_is_still_switched_off():
    """Where verifying t tokens costs more than t plain steps, a lookup kept whole still loses:
    a held match does not keep it on."""
    costly = {t: 1.2 * t * NETLIB_PLAIN for t in NETLIB_VERIFY}
    _, switched_off = calibrated_lookup_run(failed_first=0, verify=costly)
    assert switched_off >= 1


def cold_start_with_a_timed_step(step_over_first, tokens=96):
    """A cold start, the draft's step timed after its prefill at `step_over_first` times the
    target's first plain step (the block of one before the first look, two plain steps long,
    as after a prefill); its rounds cost 1.4 + 2.5 k plain steps, none accepted. Returns the
    k asked per round."""
    policy = AdaptivePolicy(acceptance_prior=0.5)
    policy.observe_draft_step("draft", step_over_first * 2 * PLAIN_STEP)
    return drafts_with_catch_up(policy, lambda k: 0, tokens, lambda k: 1.4 + 2.5 * k, catch_up=0.0,
                                first_plain=2 * PLAIN_STEP)


def test_a_draft_whose_step_costs_a_target_step_never_drafts(monkeypatch):
    """An 8-bit copy of a float32 target on a CPU steps at 1.25 of the target's first step: no
    acceptance can make it win, so it is off before its first look (which cost 2.7-4 plain
    steps) and stays off for the reply. A draft at half the target's step still looks.
    Negative control: the first look decides (COSTLY_DRAFT_OFF off)."""
    cold = AdaptivePolicy()
    assert cold.wants_draft_step("draft") and not cold.wants_draft_step("lookup")
    assert sum(cold_start_with_a_timed_step(1.25, tokens=1000)) == 0  # nor after its off periods
    assert cold_start_with_a_timed_step(0.5)[1] == 1  # its first look, after the first step
    monkeypatch.setattr(policy_module, "COSTLY_DRAFT_OFF", False)
    assert cold_start_with_a_timed_step(1.25)[1] == 1


def guessed_cold_start(hit):
    """A greedy cold start whose draft's timed step (0.6 of a plain step) guessed the
    first token (`hit`) or not; its first look (k = 1) costs 2.2 plain steps and every draft is
    rejected: the early-exit pairs of a random hybrid or sliding-window target (OpenBLAS).
    Returns the k asked per round."""
    policy = AdaptivePolicy()
    policy.observe_draft_step("draft", 0.6 * PLAIN_STEP)
    policy.observe_first_guess("draft", hit)
    return drafts_with_catch_up(policy, lambda k: 0, 96, lambda k: 1.2 + k, catch_up=1.0,
                                first_plain=2 * PLAIN_STEP)


def test_a_missed_first_guess_saves_a_hopeless_draft_its_second_round(monkeypatch):
    """Greedy, the draft's guess for the first token counts as a k = 1 round (FIRST_GUESS): with
    its miss and the first look rejected the estimate (0.47) is HOPELESS at the trial's end
    (1.47 tokens for 2.2 plain steps); with the look alone (0.59, 0.72x plain) a second round,
    a catch-up on the trial, ran first. A hit is counted too, and not after a round.
    Negative control: the guess not counted."""
    rounds = lambda asked: sum(1 for k in asked if k > 0)  # noqa: E731
    assert rounds(guessed_cold_start(hit=False)) == 1
    assert rounds(guessed_cold_start(hit=True)) >= 2
    policy = AdaptivePolicy()
    policy.observe_first_guess("draft", True)
    assert policy.source("draft").acceptance > policy_module.DEFAULT_ACCEPTANCE_PRIOR
    policy.observe(Round([0, 0], 1, 1, "draft", None), 1.0)
    before = policy.source("draft").acceptance
    policy.observe_first_guess("draft", False)
    assert policy.source("draft").acceptance == before
    monkeypatch.setattr(policy_module, "FIRST_GUESS", False)
    assert rounds(guessed_cold_start(hit=False)) >= 2


def test_before_any_plain_step_is_timed_the_first_step_is_discounted(monkeypatch):
    """The target's first step runs slower than a steady one (up to 1.16x on the tuned half), so
    a draft stepping at 0.9 of it costs a steady step: off before its first look (the sliding
    pair's 4-bit copy read 0.93-1.15 of the first step and looked in about half its cold
    starts, 6-9 plain steps each). At 0.5 it still looks. Negative control: the first step
    undivided (FIRST_STEP_DISCOUNTED off)."""
    assert sum(cold_start_with_a_timed_step(0.9)) == 0
    assert cold_start_with_a_timed_step(0.5)[1] == 1
    monkeypatch.setattr(policy_module, "FIRST_STEP_DISCOUNTED", False)
    assert cold_start_with_a_timed_step(0.9)[1] == 1


def looked_cold_start(look, step_over_first=0.8, tokens=96):
    """cold_start_with_a_timed_step at T > 0 with the prompt look's acceptance `look` (the sliding
    pair's: a 4-bit copy whose step is 0.8 of the target's first)."""
    policy = AdaptivePolicy(acceptance_prior=0.5)
    policy.observe_draft_step("draft", step_over_first * 2 * PLAIN_STEP)
    policy.observe_prompt_look("draft", look, 32)
    return drafts_with_catch_up(policy, lambda k: 0, tokens, lambda k: 1.4 + 2.5 * k, catch_up=0.0,
                                first_plain=2 * PLAIN_STEP)


def test_a_draft_the_prompt_look_shows_losing_even_with_a_free_verify_never_looks(monkeypatch):
    """At the look's 0.3 a draft stepping at 0.8 of a target step makes at best 1.3 tokens for
    1.8 steps (k = 1): off before its first look. At 0.9 it may win (k = 3: 3.4 tokens for
    3.4 steps, more at a cheaper verify): it looks. Negative control (LOOKED_DRAFT_OFF off):
    the first look decides."""
    assert sum(looked_cold_start(0.3)) == 0
    assert looked_cold_start(0.9)[1] == 1
    monkeypatch.setattr(policy_module, "LOOKED_DRAFT_OFF", False)
    assert looked_cold_start(0.3)[1] == 1


def greedy_cold_start(agreement, step_over_first=0.3, tokens=96, accepted=0):
    """A greedy cold start (the default prior 0.75) with the greedy look's argmax `agreement`
    over its prompt rows, the draft stepping at `step_over_first` of the target's first step
    (the weak pair's random draft: about 0.3); each round keeps `accepted` drafts."""
    policy = AdaptivePolicy()
    policy.observe_draft_step("draft", step_over_first * 2 * PLAIN_STEP)
    policy.observe_prompt_look("draft", agreement, GREEDY_ROWS, greedy=True)
    return drafts_with_catch_up(policy, lambda k: min(accepted, k), tokens,
                                lambda k: 1.4 + 0.3 * k, catch_up=0.0, first_plain=2 * PLAIN_STEP)


def test_a_greedy_look_is_only_a_ceiling(monkeypatch):
    """Greedy the look's agreement (GREEDY_LOOK, off by default: it costs more before the first
    token than it saves) neither replaces the guessed prior nor weighs in the acceptance
    estimate: the rounds of a target's own continuation keep more (tuned half,
    bench/results/prompt-look-accuracy.md). The ceiling lies above each tuned pair's rounds."""
    assert not AdaptivePolicy().wants_prompt_look(greedy=True)  # the default
    monkeypatch.setattr(policy_module, "GREEDY_LOOK", True)
    policy = AdaptivePolicy()
    policy.observe_prompt_look("draft", 0.1, 32, greedy=True)
    estimate = policy.source("draft")
    assert estimate.acceptance == pytest.approx(0.75) and estimate.prior_acceptance == 0.75
    assert estimate.look_ceiling == pytest.approx(greedy_look_ceiling(0.1, 32))
    for look, rounds in ((0.66, 0.87), (0.59, 0.75), (0.92, 0.95), (0.0, 0.0)):
        assert greedy_look_ceiling(look, 32) > rounds
    assert greedy_look_ceiling(0.0, 32) < greedy_look_ceiling(0.0, GREEDY_ROWS) < 0.11
    assert greedy_look_ceiling(0.0, 4) > 0.3  # (few rows say less)


def test_a_draft_that_agrees_nowhere_on_the_prompt_never_drafts_greedy(monkeypatch):
    """The weak pair's random draft agrees with its target on none of 16 prompt rows: at the
    ceiling's 0.11 a k = 1 round makes 1.11 tokens for 1.3 steps even with a free verify, so
    it is off before its first look and its first rounds (the weak pair without lookup: 0.97x
    plain). The shipped pair's 0.66 still looks, and keeps drafting when its rounds win.
    Negative controls: GREEDY_LOOK off, or LOOKED_DRAFT_OFF off, and the first look decides."""
    monkeypatch.setattr(policy_module, "GREEDY_LOOK", True)
    assert sum(greedy_cold_start(0.0)) == 0
    asked = greedy_cold_start(0.66, accepted=4)
    assert asked[1] == 1 and sum(k > 0 for k in asked) > 10
    monkeypatch.setattr(policy_module, "GREEDY_LOOK", False)
    assert greedy_cold_start(0.0)[1] == 1
    monkeypatch.setattr(policy_module, "GREEDY_LOOK", True)
    monkeypatch.setattr(policy_module, "LOOKED_DRAFT_OFF", False)
    assert greedy_cold_start(0.0)[1] == 1


def test_after_a_costly_draft_is_off_lookup_drafts_in_the_trial():
    """The costly draft goes off as soon as the target's first step is timed, so prompt lookup,
    asked first each round, need not wait out the trial for its first look (a copy task)."""
    policy = AdaptivePolicy()
    policy.observe_draft_step("draft", 3.0 * PLAIN_STEP)
    assert policy.proposal_length("draft") == 0 and policy.proposal_length("lookup") == 0
    policy.observe(Round([0], 0, 0, "target", None), 2 * PLAIN_STEP)
    assert policy.proposal_length("lookup") > 0 and policy.proposal_length("draft") == 0


def test_a_costly_draft_is_off_at_the_trials_average_when_lookup_went_first(monkeypatch):
    """A copy task: lookup's round comes first, so the first plain step follows it (2.2 steps:
    the rewind's replay, the queue's fill; the block's last lap is short, 0.3). A draft at 1.3
    plain steps is below that first step but not below the trial's average: off before any
    round of its own. Negative control: the rule off, it drafts its first rounds."""
    def drafted(rule):
        monkeypatch.setattr(policy_module, "COSTLY_DRAFT_OFF", rule)
        policy = AdaptivePolicy()
        policy.observe_draft_step("draft", 1.3 * PLAIN_STEP)
        assert policy.proposal_length("lookup") and not policy.proposal_length("draft")
        policy.observe(Round([0, 0], 2, 1, "lookup", None), 3 * PLAIN_STEP)
        rounds, seconds = 0, itertools.chain([2.2 * PLAIN_STEP, PLAIN_STEP, PLAIN_STEP,
                                              0.3 * PLAIN_STEP], itertools.repeat(PLAIN_STEP))
        for _ in range(40):
            if policy.proposal_length("draft"):
                rounds += 1
                policy.observe(Round([0], 1, 0, "draft", None), 4 * PLAIN_STEP)
            else:
                for _ in range(policy.plain_steps()):
                    policy.observe(Round([0], 0, 0, "target", None), next(seconds))
        return rounds
    assert drafted(True) == 0
    assert drafted(False) >= 1


def test_a_calibrated_policy_does_not_ask_for_a_timed_step():
    """A calibration already knows the draft's cost: no extra step before the first round."""
    from mlx_spec.costmodel import CostPrior
    prior = CostPrior(plain_seconds=0.01, step_seconds={"draft": 0.002},
                      verify_seconds={1: 0.01, 2: 0.011, 4: 0.012, 8: 0.015},
                      acceptance={"draft": 0.8})
    assert not AdaptivePolicy(prior=prior).wants_draft_step("draft")


def copy_task_asks(wait_for_match, monkeypatch, gap=3, lookup_rounds=((2, 2), (6, 3))):
    """The float16 copy task's opening as the loop drives the policy: lookup drafts first (its
    rounds `lookup_rounds`, (k, accepted)), then has no match for `gap` plain steps, then
    matches again. Returns what the draft model was asked at each point of the gap and
    the plain block lengths asked for."""
    monkeypatch.setattr(policy_module, "WAIT_FOR_MATCH", wait_for_match)
    policy = AdaptivePolicy()
    policy.observe_draft_step("draft", 0.4 * PLAIN_STEP)  # a cheap draft: not off
    for k, n in lookup_rounds:
        while not policy.proposal_length("lookup"):  # after a failed round: the draft's first
            if policy.proposal_length("draft"):  # look, the trial's steps
                policy.observe(Round([0], 1, 0, "draft", None), 2 * PLAIN_STEP)
            else:
                policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
        policy.proposal_length("draft")
        policy.observe(Round([0] * (n + 1), k, n, "lookup", None), cpu_round(k))
    asked, blocks = [], []
    for _ in range(gap):  # lookup finds nothing: the draft is asked next, as in the loop
        policy.proposal_length("lookup")
        k = policy.proposal_length("draft")
        asked.append(k)
        if k:
            policy.observe(Round([0], k, 0, "draft", None), 2 * PLAIN_STEP)
        else:
            blocks.append(policy.plain_steps())
            policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)  # the match came back
    return asked, blocks


def test_a_paid_sources_first_rounds_wait_while_lookups_matches_hold(monkeypatch):
    """A copy task: lookup kept 5 of its first 8 drafts and its match breaks off for a few
    tokens. The draft model's first rounds (each a rejected k = 1 round at two plain steps in
    the float16 copy, where lookup's next match came 2-3 tokens later) wait: plain steps, in
    blocks that end MATCH_GAP_TOKENS after lookup's last round (the loop also ends them at the
    next match; the cold start's trial, whose steps lookup's rounds came before, runs first).
    Negative control: WAIT_FOR_MATCH off, the draft drafts in the gap once the trial is over."""
    gap = policy_module.MATCH_GAP_TOKENS
    asked, blocks = copy_task_asks(True, monkeypatch, gap=gap)
    assert asked == [0] * gap
    assert blocks[PLAIN_TRIAL_STEPS:] == [gap - i for i in range(PLAIN_TRIAL_STEPS, gap)]
    asked, _ = copy_task_asks(False, monkeypatch, gap=gap)
    assert asked[PLAIN_TRIAL_STEPS] > 0


def test_a_draft_does_not_wait_for_a_lookup_that_does_not_hold(monkeypatch):
    """Lookup's record decides: a second round that kept none of its 6 (2 of 8 kept: an
    ordinary prompt's chance match) makes no one wait, and a gap longer than MATCH_GAP_TOKENS
    ends the wait."""
    gap = policy_module.MATCH_GAP_TOKENS
    asked, _ = copy_task_asks(True, monkeypatch, gap=gap, lookup_rounds=((2, 2), (6, 0)))
    assert asked[PLAIN_TRIAL_STEPS] > 0
    asked, _ = copy_task_asks(True, monkeypatch, gap=gap + 2)
    assert asked[:gap] == [0] * gap and asked[gap] > 0


def test_a_copy_tasks_first_lookup_round_is_timed_while_a_first_look_is_due():
    """The step before a paid source's first look is not timed (it carries the prefill's
    aftermath), but a lookup round in its place is: untimed, lookup's fit had one k (its 6),
    took cost as proportional to k + 1, and the float16 copy task's next rounds proposed 1
    token each where lookup alone proposed 4 and more."""
    policy = AdaptivePolicy()
    policy.observe_draft_step("draft", 0.4 * PLAIN_STEP)
    for k, n in ((2, 2), (6, 3)):
        assert policy.proposal_length("lookup") == k and policy.proposal_length("draft") == 0
        policy.observe(Round([0] * (n + 1), k, n, "lookup", None), cpu_round(k))
    for _ in range(PLAIN_TRIAL_STEPS):
        policy.observe(Round([0], 0, 0, "target", None), PLAIN_STEP)
    assert policy.proposal_length("lookup") >= 4


class OffWatch(AdaptivePolicy):
    """The policy, counting the rounds drafted before its first switch-off, and the tokens."""

    drafted_before_off, emitted = 0, 0

    def observe(self, round_, seconds):
        if round_.num_drafted and not self.switched_off:
            self.drafted_before_off += 1
        self.emitted += len(round_.tokens)
        super().observe(round_, seconds)


def first_rounds_drafted(accept_rate, steady, seeds=40, spread=0.15, step=None, look=None):
    """Per 96-token run at T > 0 (chances drawn around accept_rate), the rounds drafted before
    the source was first switched off (all of them when it never was), and the tokens per
    plain step over all runs. `step`: the draft step the loop timed after the prefill (plain
    steps); `look`: the prompt look's acceptance."""
    counts, emitted, seconds = [], 0, 0.0
    for seed in range(seeds):
        chances_of, accepted_of = sampled_stream(random.Random(seed), accept_rate, spread)
        policy, spent = OffWatch(acceptance_prior=0.5), []
        if step is not None:
            policy.observe_draft_step("draft", step * PLAIN_STEP)
        if look is not None:
            policy.observe_prompt_look("draft", look, 32)
        drafts_with_catch_up(policy, accepted_of, 96, steady, 0.0, chances_of=chances_of,
                             spent=spent)
        counts.append(policy.drafted_before_off)
        emitted, seconds = emitted + policy.emitted, seconds + sum(spent)
    return counts, emitted * PLAIN_STEP / seconds


def test_a_sampled_draft_that_cannot_win_at_any_k_is_off_before_its_k3_round(monkeypatch):
    """A weak draft at T = 0.7 (its drafts kept ~20% of the time, a k = 1 round costing 1.9
    plain steps, as the float32 early-exit pair's on a CPU) keeps at most 1 / (1 - a) tokens a round
    however long it drafts, so after its two k = 1 rounds it cannot win at any k and is off
    without the k = 3 round (2.6 plain steps for about one token). Negative control
    (CANNOT_WIN_OFF off): the three first rounds run out, and the runs decode slower."""
    weak = lambda k: 1.55 + 0.35 * k  # noqa: E731
    counts, rate = first_rounds_drafted(0.2, weak)
    assert max(counts) <= 2
    monkeypatch.setattr(policy_module, "CANNOT_WIN_OFF", False)
    control, control_rate = first_rounds_drafted(0.2, weak)  # (the trial's 5 steps decay the
    # prior a little more than 3 did: 2 runs of 40 end at a hopeless verdict after 2 rounds)
    assert sum(1 for c in control if c >= 3) >= 0.9 * len(control) and control_rate < rate


@pytest.mark.parametrize("accept_rate,steady", [
    (0.8, lambda k: 2.0 + 0.15 * k),  # a strong draft whose k = 1 round costs 2 plain steps
    (0.55, lambda k: 1.1 + 0.25 * k)])  # a marginal winner (the shipped pair at T = 0.7)
def test_the_bound_does_not_end_a_sampled_winners_first_rounds(accept_rate, steady):
    counts, _ = first_rounds_drafted(accept_rate, steady)
    assert sum(1 for c in counts if c < 3) <= 2


# The MTP head on the float32 target at T = 0.7 with OpenBLAS (mtp-f32): a k = 1 round costs 2
# plain steps (a 2-token verify pass is 1.5), each further draft 0.45 (its timed step 0.43);
# the prompt look reads 0.6, the rounds' chances 0.5-0.6. The strong pair: the same k = 1
# round, its step timed at 0.47 and costing 0.34 in its rounds, its drafts kept 0.85-0.95.
MTP_F32 = dict(steady=lambda k: 1.55 + 0.45 * k, step=0.43)
STRONG = dict(steady=lambda k: 1.66 + 0.34 * k, step=0.47)


def test_a_sampled_source_that_no_k_can_make_win_is_off_after_its_first_look(monkeypatch):
    """At acceptance 0.6 and those costs no k wins (k = 1: 1.6 tokens in 2 steps; k = 3: 2.2 in
    2.9), but 1 / (1 - a) tokens a round of t(1) says 1.25x: with each further draft costing
    its timed step (DRAFT_STEPS_IN_BOUND) and the prompt look's acceptance in place of the
    guessed 0.5, the source is off after its first look, in nearly every run, and the runs
    decode faster. Negative control: without them its first rounds run out."""
    counts, rate = first_rounds_drafted(0.55, look=0.6, **MTP_F32)
    assert sum(1 for c in counts if c <= 1) >= 0.9 * len(counts)
    monkeypatch.setattr(policy_module, "DRAFT_STEPS_IN_BOUND", False)
    monkeypatch.setattr(policy_module, "PROMPT_LOOK", False)
    control, control_rate = first_rounds_drafted(0.55, look=0.6, **MTP_F32)
    assert sum(1 for c in control if c >= 3) >= 0.5 * len(control) and control_rate < rate


def test_the_draft_step_bound_spares_a_strong_draft_the_prompt_look_vouches_for(monkeypatch):
    """The strong pair's first look costs what the MTP head's does and its step is timed as
    dear: only acceptance tells them apart. The prompt look gives it (0.9), and its first
    rounds run. Without a look (its budget bought too few rows) the draft steps stay out of
    the bound (DRAFT_STEPS_NEED_LOOK), and its first rounds still run. Negative control: the
    draft steps counted on the guessed 0.5 end them."""
    counts, _ = first_rounds_drafted(0.88, look=0.9, **STRONG)
    assert sum(1 for c in counts if c < 3) <= 2
    monkeypatch.setattr(policy_module, "PROMPT_LOOK", False)
    blind, _ = first_rounds_drafted(0.88, look=0.9, **STRONG)
    assert sum(1 for c in blind if c < 3) <= 2
    monkeypatch.setattr(policy_module, "DRAFT_STEPS_NEED_LOOK", False)
    guessed, _ = first_rounds_drafted(0.88, look=0.9, **STRONG)
    assert sum(1 for c in guessed if c < 3) >= 0.5 * len(guessed)


def test_a_guessed_prior_alone_does_not_end_a_strong_drafts_first_rounds(monkeypatch):
    """The strong pair on the AMD EPYC with no look (its budget bought none): a k = 1 round of
    2.3 plain steps, drafts kept ~90% of the time. After one round its estimate is mostly the
    guessed 0.5 (0.59), which at cost proportional to k + 1 reads below HOPELESS; the round's
    own chances (0.9) do not, and HOPELESS_FIRST_OWN reads the better of the two. Its first
    rounds run; weak and marginal drafts are still off after one or two rounds. Negative
    control: the estimate alone ends most strong runs after their first round."""
    dear = lambda k: 1.96 + 0.34 * k  # noqa: E731
    strong, rate = first_rounds_drafted(0.9, dear, step=0.47)
    assert sum(1 for c in strong if c < 3) <= 2
    for weak_rate in (0.2, 0.55):
        weak, _ = first_rounds_drafted(weak_rate, dear, step=0.47)
        assert max(weak) <= 2
    monkeypatch.setattr(policy_module, "HOPELESS_FIRST_OWN", False)
    control, control_rate = first_rounds_drafted(0.9, dear, step=0.47)
    assert sum(1 for c in control if c < 3) >= 0.5 * len(control) and control_rate < rate


def test_the_rule_fires_study_sees_the_rule_act_and_puts_the_policy_back():
    """rule_fires wraps the predicate: on the weak stream it records firings (with the
    acceptance then), on the winning one none, and afterwards the policy is as it was."""
    from bench.studies.rule_fires import watched
    original = AdaptivePolicy._cannot_win
    log = []
    restore = watched("_cannot_win", log)
    try:
        first_rounds_drafted(0.2, lambda k: 1.55 + 0.35 * k, seeds=5)
        assert log and all(f["acceptance"] < 0.5 for f in log)
        log.clear()
        first_rounds_drafted(0.8, lambda k: 2.0 + 0.15 * k, seeds=5)
        assert not log
    finally:
        restore()
    assert AdaptivePolicy._cannot_win is original


def test_the_long_replies_study_flips_several_rules_together():
    from bench.studies.long_replies import _with_flag, flipped_label
    rules = "PROMPT_LOOK,DRAFT_STEPS_IN_BOUND"
    read = lambda ids: (policy_module.PROMPT_LOOK, policy_module.DRAFT_STEPS_IN_BOUND)  # noqa: E731
    assert _with_flag(rules, True, read)(None) == (False, False)
    assert _with_flag(rules, False, read)(None) == (True, True)
    assert (policy_module.PROMPT_LOOK, policy_module.DRAFT_STEPS_IN_BOUND) == (True, True)
    assert flipped_label(rules) == "defaults, PROMPT_LOOK = False, DRAFT_STEPS_IN_BOUND = False"


def pipelined_laps(steps, fill=0.4):
    """A plain block's laps as the loop times them: its steps are queued back to back, so the
    first lap carries the pipeline's fill (two steps and `fill`, less the last lap's) and the
    last is short (its step ran during the lap before); the block costs steps + fill."""
    if steps == 1:
        return [PLAIN_STEP + fill]
    return [2 * PLAIN_STEP + fill - 0.2] + [PLAIN_STEP] * (steps - 2) + [0.2]


def run_with_pipelined_laps(policy, steady, chances_of, accepted_of, tokens=96, spent=None):
    """drafts_with_catch_up's rounds, each plain block timed lap by lap as the loop times it
    (pipelined_laps); the step before the first look is untimed, as in the loop."""
    spent = [] if spent is None else spent
    emitted = 0
    while emitted < tokens:
        k = policy.proposal_length("draft")
        if k == 0:
            laps = pipelined_laps(policy.plain_steps())
            for i, lap in enumerate(laps):
                policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), lap)
            spent.extend(laps)
            emitted += len(laps)
            continue
        chances = chances_of(k)
        n = accepted_of(chances)
        spent.append(steady(k))
        policy.observe(Round([0] * (n + 1), k, n, "draft", None, chances), spent[-1])
        emitted += n + 1
    return spent


def test_a_plain_step_is_timed_by_the_laps_inside_its_block(monkeypatch):
    """The cold start's trial is one block: its first lap carries the pipeline's fill, its last
    is short. The median of the laps between them is the plain step; every lap averaged (the
    rule off, the trial 3 steps) reads a step and a third of the fill."""
    for rule, expected in ((True, PLAIN_STEP), (False, PLAIN_STEP + 0.4 / 3)):
        monkeypatch.setattr(policy_module, "STEADY_PLAIN_STEPS", rule)
        policy = AdaptivePolicy()
        policy.proposal_length("draft")
        policy.observe(Round([0], 0, 0, "target", None, opens_block=True),
                       policy.plain_steps() * 3.0)  # untimed: the step before a first look
        policy.observe(Round([0, 0], 1, 1, "draft", None), cpu_round(1))  # the first look
        assert policy.proposal_length("draft") == 0
        for i, lap in enumerate(pipelined_laps(policy.plain_steps())):
            policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), lap)
        assert policy.measured_plain_seconds == pytest.approx(expected)
        # a block opened without a drafted round between: its first lap is not steady
        for i, lap in enumerate(pipelined_laps(3)):
            policy.observe(Round([0], 0, 0, "target", None, opens_block=i == 0), lap)
        steady = policy_module.trial_steps() - 3 + 1  # the trial's inner laps, and this one
        assert list(policy.steady_laps) == pytest.approx([PLAIN_STEP] * steady)


def test_a_source_losing_a_tenth_is_off_when_plain_steps_are_timed_steady(monkeypatch):
    """An MTP-like source at T > 0 (chances ~0.7, a round of k costing 1.6 + 0.4 k plain steps:
    at best 0.91x plain at k = 2 or 3). Against the trial's steady laps it is switched off in
    its first rounds; against every lap averaged (the fill a third of a step in a 3-step trial)
    it looks level with plain, drafts on in most runs, and the runs decode slower."""
    mtp_like = lambda k: 1.6 + 0.4 * k  # noqa: E731

    def runs():
        drafting_on, emitted, seconds = 0, 0, 0.0
        for seed in range(40):
            chances_of, accepted_of = sampled_stream(random.Random(seed), 0.7, 0.1)
            policy = OffWatch(acceptance_prior=0.5)
            spent = run_with_pipelined_laps(policy, mtp_like, chances_of, accepted_of)
            drafting_on += policy.drafted_before_off > 8  # past its first rounds and a verdict
            emitted, seconds = emitted + policy.emitted, seconds + sum(spent)
        return drafting_on, emitted * PLAIN_STEP / seconds

    on, rate = runs()
    assert on <= 4
    monkeypatch.setattr(policy_module, "STEADY_PLAIN_STEPS", False)
    control_on, control_rate = runs()
    assert control_on >= 20 and control_rate < rate


def test_the_plain_laps_study_reads_both_estimates_as_the_trial_ends():
    """plain_laps wraps _judge_first_looks: on a run with pipelined laps it reads the steady
    median (a plain step) and every lap's mean (a step and a fifth of the fill over the 5-step
    trial), and afterwards the policy is as it was."""
    from bench.studies import plain_laps
    from types import SimpleNamespace
    original = AdaptivePolicy._judge_first_looks

    def run(*args, **kwargs):  # the run of the defaults, replaced by the synthetic stream
        chances_of, accepted_of = sampled_stream(random.Random(0), 0.7, 0.1)
        run_with_pipelined_laps(AdaptivePolicy(acceptance_prior=0.5), lambda k: 1.6 + 0.4 * k,
                                chances_of, accepted_of)
        return iter(())
    plain_laps.speculative_generate_step, saved = run, plain_laps.speculative_generate_step
    try:
        pair = SimpleNamespace(target_model=None, draft_model=None, draft_options={})
        seen = plain_laps.trial_readings(pair, [1, 2], 0.7, 96)
    finally:
        plain_laps.speculative_generate_step = saved
    assert seen["steady"] == pytest.approx(PLAIN_STEP)
    assert seen["every_lap"] == pytest.approx(PLAIN_STEP + 0.4 / (PLAIN_TRIAL_STEPS - 1))
    assert AdaptivePolicy._judge_first_looks is original
