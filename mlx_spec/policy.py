"""How many tokens each drafting source proposes per round, and when not to speculate at all.

A policy answers `proposal_length(source)` before each round (0 = do not ask
that source; "draft" is the draft model, "lookup" prompt lookup, "suffix" suffix drafting), decodes
plainly for `plain_steps()` steps when no source proposes, and is told every
finished round via `observe(round, seconds)`: the seconds the round took, as
the loop timed it (a policy keeps no clock, so a sharded target can hand every
rank rank 0's times). Policies only choose lengths; exactness never
depends on them, because any length that does not peek at the target's
randomness leaves the output distribution untouched.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Dict, List, Optional, Protocol, Sequence

from .costmodel import CostPrior, expected_tokens_per_round
from .defaults import (DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_LOOKUP_TOKENS,
                       DEFAULT_NUM_DRAFT_TOKENS)

DEFAULT_ADAPTIVE = True  # the bench: adaptive beat the best fixed k over the prompt set (docs/benchmarks.md)
DEFAULT_DECAY = 0.9  # weight of the past in the online estimates, per round
FIRST_OFF_STEPS = 32  # tokens decoded without a source after it is switched off; doubles each time
MAX_OFF_STEPS = 256
LONG_OFF_STEPS = 128  # the off period when a source loses and could win little anyway (below)
# ... when at the better of its acceptance and its prior it would still not beat plain
# decoding by this much (predicted tokens/s over plain's): probing again costs rounds
# and can win little.
SMALL_GAIN = 1.1
# With no calibration a source is judged after its first rounds, of these fractions of
# its initial k. The first is not timed (below); the other two give the cost fit a
# slope. Short first: on a machine where drafting loses, each of these rounds costs
# more than the tokens it brings.
FIRST_FRACTIONS = (0.25, 0.25, 0.75)  # a host search (lookup) skips the untimed first
FIRST_ROUNDS = len(FIRST_FRACTIONS)
# A draft model's round after it sat out this many tokens (or its very first round)
# also feeds it every token it missed: a one-off catch-up that measured +25% on a k = 2
# round, which made a slope from two rounds nearly twice the steady one and switched
# winning drafts off (docs/benchmarks.md). Such a round counts for acceptance, not cost.
CATCH_UP_TOKENS = 16
UNTIMED_CATCH_UP = True  # False: fit such rounds too (the negative control of a test)
PROBE_ROUNDS = 2  # rounds tried after an off period before the source is judged again (the first
# catches a draft model up: its acceptance counts, its time does not)
PLAIN_TRIAL_STEPS = 6  # plain steps timed before the first switch-off (the fit's t(0) is noisy)
SHORT_TRIAL_STEPS = 4  # the trial with STEADY_PLAIN_STEPS off (as before it: one steady lap)
# With no calibration a paid source (a draft model, an MTP head, a block drafter) drafts its
# first round inside that trial, after its first step (which carries the prefill), while it
# is nearly in step with the prompt: a round after the trial would first catch it up on the
# trial's tokens, which on a draft as costly as its target (a quantized copy on a CPU) took
# two rounds' time. The trial's other steps are then timed, and a source that cannot win
# even at its prior's acceptance (HOPELESS) is off before it ever catches up (issue 29:
# the hybrid and sliding pairs).
FIRST_LOOK = True  # False: the whole trial first (the negative control of a test)
FIRST_LOOK_AFTER = 1  # plain steps before the first look
# A host search (prompt lookup, suffix drafting) drafts during the trial whenever it has a
# match: a copy task's answer starts matching at its first token, and the trial's four plain
# steps were a tenth of a 96-token copy. The trial then goes on while it finds nothing. It
# waits for the trial once a verdict finds it losing, and after a paid source's first look,
# whose verdict wants the trial's steps at once (with lookup drafting meanwhile, the
# early-exit pair's draft waited and the defaults lost 6% at T = 0).
LOOKUP_IN_TRIAL = True
# A source must have lost a verdict before, have this many rounds behind it, or lose
# clearly (CLEAR_LOSS) before its off period may be LONG_OFF_STEPS: three rounds at
# T > 0 are mostly the prior.
LONG_OFF_EVIDENCE = 8
PLAIN_BLOCK = 16  # plain steps queued back to back while no source proposes
OFF_MARGIN = 0.05  # switch off only when predicted >5% slower: estimates are noisy, ties cost little
# ... in two verdicts in a row, unless it is predicted this much slower: one rejected
# round at T > 0 moves the estimate by more than OFF_MARGIN, and switching a winning
# source off costs a whole off period, keeping a losing one a round costs little.
CLEAR_LOSS = 0.15
HOPELESS = 0.7  # predicted this much of plain's speed: off without the remaining first rounds
# At T > 0 a source in its first rounds (or a probe's) is also off without the rest when it
# cannot win at ANY k: a round keeps at most 1 / (1 - a) tokens on average however long it
# drafts, and costs at least its k = 1 round (verifying more costs more), so at its acceptance
# estimate a (the round's chances, with the prior) it makes at most that many tokens per
# t(1) seconds: a bound that needs no slope, unlike a prediction from k = 1 rounds alone
# (FIRST_ROUNDS_OPTIMISTIC, below). Only with chances (SOFT_ACCEPTANCE): at T = 0 two rejected
# k = 1 rounds are coin flips, chances measure. Where it fires (OpenBLAS, T = 0.7 / 1, 9 runs
# each, bench/results/cannot-win-fires-openblas.md): the float32 early exit mostly right after
# its first look (a k = 1 round of 1.9 plain steps, a = 0.4) in 8 / 9 runs; the float16 early
# exit in its probe after an off period (a = 0.1-0.2) in 5 / 2; the MTP head at T = 1 in 5;
# never on the zoo's winning pairs (docs/benchmarks.md).
CANNOT_WIN_OFF = True  # False: the first rounds run out (the negative control of a test)
# ... and each draft after the first costs at least its paid source's timed step (the step the
# loop times after the prefill: a draft model's, an MTP head's). A round at k = 1 on the
# mtp-f32 pair costs 2.1 plain steps with OpenBLAS (a 2-token verify pass is 1.5 plain
# steps), each further draft 0.4-0.5: at its acceptance of 0.5-0.6 at T = 0.7 no k wins, where
# 1 / (1 - a) tokens a round of t(1) said 1.2x plain. It needs a measured acceptance (the
# prompt look's, below): the strong pair's first look costs as much and its step is timed as
# dear, and at the guessed prior of 0.5 it would be off too (docs/benchmarks.md).
DRAFT_STEPS_IN_BOUND = True  # False: the bound without them (the negative control of a test)
# ... so the draft steps count only once the look has measured it (SourceEstimate.looked). The
# look's row budget (LOOK_BUDGET, below) can leave the look out, and then the bound read the
# guessed 0.5 moved by one round: on the AMD EPYC the strong pair's budget buys only a few rows,
# and its winning draft was off after its first look in 3-5 of 12 cold starts at T > 0, each
# time at an estimate of 0.57-0.61, no look's (bench/results/cannot-win-fires-tuned-amd.md;
# with the change strong 1.02x at T = 0.7 and 1, docs/benchmarks.md).
DRAFT_STEPS_NEED_LOOK = True  # False: on the guessed prior too (the negative control of a test)
# At T > 0 with no calibration a source's prior acceptance is measured on the prompt's last
# positions from the prefill's passes (mlx_spec/prompt_look.py), in place of the guess.
PROMPT_LOOK = True  # False: the guessed prior (the negative control of a test)
# With the look's acceptance a paid source need not look at all when even a verify pass as cheap
# as a plain step leaves it below 0.95x plain at every k: a round of k then costs one plain step
# plus k of its timed draft steps. The sliding pair's first look (a k = 1 round of 3.7 plain
# steps, its draft step 0.8 of the target's first) was 2% of a 96-token reply at T > 0.
LOOKED_DRAFT_OFF = True  # False: its first look decides (the negative control of a test)
# Greedy, the look reads how often the draft's argmax matched the target's on the prompt's last
# positions, and a target's own greedy continuation is easier to guess than its prompt: on the
# tuned half the rounds' per-draft acceptance raised the look's odds 1.6-3.4x (shipped 0.66 ->
# 0.87, noisy-f32 0.59 -> 0.75, strong 0.92 -> 0.95; weak 0.00 -> 0.00:
# bench/results/prompt-look-accuracy.md). So greedy the look would be no prior: it would only
# switch off (LOOKED_DRAFT_OFF) a draft that loses even at GREEDY_LOOK_ODDS times the look's
# odds, one that agrees with its target almost nowhere on the prompt. Tried and left off: on the
# weak pair without lookup it took the decoding after the first token from 0.95x to 0.99x plain
# (the first rounds and a probe, all rejected, gone), but it runs before the first token, where
# no table looked: 1.0-2.6 plain steps on the zoo's pairs (OpenBLAS; 5.1 with a quantized
# full-depth draft), and over a whole 96-token reply timed from the call it lost up to 7%
# (strong, 0.93x) and won nowhere by more than 2% (docs/benchmarks.md, "The prompt look's cost
# before the first token").
GREEDY_LOOK = False  # True: the greedy look (a test turns it on)
GREEDY_LOOK_ODDS = 4.0
# The look's rows (at most prompt_look.ROWS; fewer than MIN_ROWS: none) are as many as
# LOOK_SHARE of the reply's plain time buys (look_rows). Its cost in prompt tokens' prefill
# time, the target's: LOOK_FIXED_TOKENS (the last layers over the prefill's last chunk, the
# sync) plus LOOK_ROW_TOKENS a row (the output layers), measured on the zoo's pairs after
# 32-token prompts with both BLAS (0.4-11.9 and 0.16-0.47 on seven pairs;
# bench/results/look-rows-cost-{netlib,openblas}.md). With the reference BLAS a CPU prefills
# a float32 pair's token in 0.23-0.34 of a plain step, and its look cost 4-7% of a 96-token
# reply and bought nothing (with ÷ without 0.93-0.96x): over 96 tokens it now takes none; a
# float16 pair's token takes 0.16-0.17 with either BLAS (MLX's CPU backend has no BLAS for it),
# with OpenBLAS a float32 pair's 0.08-0.15.
# Flipped: 1.04-1.05x on the float32 pairs with netlib, the strong pair's look kept; 1.00-1.03x
# with OpenBLAS (bench/results/look-budget-flip-*.md; docs/benchmarks.md). The prefill's
# time also holds an MTP head's catch-up and a first call's warm-up: the rows err fewer. A
# reply capped high (max_tokens of a server) buys every row.
LOOK_BUDGET = True  # False: every row gathered, whatever it costs (the negative control)
LOOK_SHARE = 0.02
LOOK_FIXED_TOKENS = 8.0
LOOK_ROW_TOKENS = 0.4
# Greedy, a draft model's timed step (COSTLY_DRAFT_OFF) is its guess for the first token: the
# policy counts whether the target's first token matched, as a k = 1 round's acceptance
# (untimed), before the first look. It costs no pass. On the held-out early-exit pairs whose
# draft agrees with its target almost nowhere (hybrid-skip-f32, sliding-skip-f32) the first
# look alone left the estimate just above HOPELESS and a second round (a catch-up on the
# trial, about 3 plain steps) ran before the draft went off; with the guess's miss counted the
# trial's end switches it off. On the tuned half it moved nothing (0.99-1.01x, 15 repeats:
# bench/results/first-guess-tuned-openblas.md; docs/benchmarks.md, "Two free signals").
FIRST_GUESS = True  # False: not counted (the negative control of a test)
# A plain block's steps are queued back to back: its first lap carries the pipeline's fill (about
# two steps, more right after a round), its last is short (its step ran during the lap before).
# Averaging every lap is unbiased over long blocks, not over the cold start's short trial
# after a first look: an MTP head losing 10% (mtp-f32, OpenBLAS) could look level with plain,
# and no plain step is timed while it drafts. With the rule a plain step is the median of the
# recent laps that have a lap before and after them in their block; the trial is 5 timed
# steps, 3 of them steady (one alone read 6.5 ms against 4.7 once). At the trial's end it reads
# 1.01-1.08x plain decoding's step on the float32 zoo pairs; every lap's mean over the 3-step
# trial before it, 1.07-1.22x (bench/results/plain-laps*-openblas.md; docs/benchmarks.md).
STEADY_PLAIN_STEPS = True  # False: every lap weighs (the negative control of a test)
STEADY_LAPS = 64  # the steady laps the median is over
# Tried and left off: also ending the first rounds (and a probe's first) when even at the better
# of its acceptance and its prior the source is predicted slower than plain by CLEAR_LOSS, its
# cost taken as proportional to k + 1 from k = 1 rounds alone. On a CPU's fast float32 targets
# it saved the second k = 1 and the k = 3 round (+0-4% at T > 0, 96 tokens), but the strong pair's
# first look costs the same two plain steps as the MTP head's and only acceptance tells them
# apart: its winning draft went off after one round (1.18x -> 1.04x plain at T = 0.7;
# docs/benchmarks.md, "A rule tried and left off").
FIRST_ROUNDS_OPTIMISTIC = False
# At T > 0 with no look (LOOK_BUDGET bought none) a source's estimate after its first round is
# mostly the guessed prior (SAMPLING_ACCEPTANCE_PRIOR, weighing as four rounds), and HOPELESS
# read it: with cost taken as proportional to k + 1 from that one k = 1 round, a winning draft
# whose first round cost 2.3 plain steps or more (the strong pair's on the AMD EPYC, its
# look skipped) went off at an estimate of 0.57-0.61 in 1 and 4 of 12 cold starts
# (bench/results/hopeless-fires-strong-need-look-amd.md). As with DRAFT_STEPS_NEED_LOOK, a
# guess alone does not switch a source off: after its first round HOPELESS reads the better
# of the estimate and that round's own chances (a draft that fails reads low either way).
HOPELESS_FIRST_OWN = True  # False: the estimate alone (the negative control of a test)
# After its first off period a source is probed again (a hard opening must not keep a
# good draft off); after later ones only while speculation's net loss against plain
# decoding (round seconds - tokens x a plain step, over every speculative round; wins
# count as negative loss) stays under this fraction of the time decoded. A source that
# keeps losing then costs little more than its first verdict and one probe, and one
# that wins its probes is probed whenever its off period ends.
PROBE_BUDGET = 0.02
# A calibration's verdict switches a paid source off before its first round, but not a host
# search: lookup's acceptance is the text's (a copy task accepts ~90%, the calibration's
# ordinary prompts far less), and it drafts only where it has a match. With netlib's linear
# verify cost the calibration judged lookup a loser and the copy task ran at 1.01-1.06x plain
# against lookup alone's 1.5x.
CALIBRATION_JUDGES_LOOKUP = False  # True: the old rule (the negative control of a test)
# A host search's drafts stand or fall together (a match holds or it does not), so one failed
# round weighs far more in the per-draft acceptance model than it should: with a netlib
# calibration, lookup's first round on a copy prompt failing (k = 2, none kept) and the next
# two kept whole left its estimate at 0.77, predicted 0.82x plain, off for the rest of a
# 96-token reply (the calibrated copy task fell to 1.00x plain in 4 of 5 runs). No verdict is
# taken on a round whose whole proposal was kept, while the source would win at acceptance 1.
MATCH_HOLDS = True  # False: the old rule (the negative control of a test)
# A probe after an off period also feeds a draft model every token decoded meanwhile. On a
# GPU that catch-up is one short prefill; on a CPU, where a quantized draft's products run
# token by token, it grows with the backlog: on the sliding-window pair a probe after 128
# tokens took 319 ms (55 plain steps) and the defaults ran at 0.85x plain over 384 tokens.
# So the probe budget counts the probe's predicted catch-up too, for every probe of a source
# that could win little anyway (LONG_OFF_STEPS) and every probe after the first. The cost
# per token: the draft's prompt prefill (timed by the loop), then its own catch-up rounds.
CATCH_UP_IN_BUDGET = True  # False: the old rule (the negative control of a test)
# With no calibration a draft model's step is timed once, right after its prompt prefill (the
# faster of two steps on the prompt's last token, each undone), and set against a target step:
# a draft whose step costs as much as a target step cannot make decoding faster (a round of k
# drafts then costs at least k + 1 target steps, for at most k + 1 tokens), so it is off before
# its first look, and again whenever its off period ends: it never drafts in the reply. With OpenBLAS
# the full-size 8-bit and 4-bit copies of the hybrid and sliding targets step at 1.19-1.35 of the
# target's first step, every other draft of the zoo at 0.28-0.61 (bench/results/draft-step-*.md);
# their first look had cost 2.7-4 plain steps. The first step runs slower than a steady one, so
# once the trial's plain steps are timed their average is the bar, for a source still in its
# first rounds (a copy task's lookup rounds come first; netlib's hybrid copy steps at 1.0 of it).
COSTLY_DRAFT_OFF = True  # False: the first look decides (the negative control of a test)
# Until any plain step is timed the draft's step is set against the target's first step divided
# by FIRST_STEP_SLOWER, the top of the tuned half's range: the first ran 1.03-1.16x a steady
# step there (bench/results/draft-step-openblas.md; f16 1.03-1.07, f32 1.16). Undivided, the
# held-out sliding pair's 4-bit copy (its step 1.3-1.6 of a steady one) read 0.9-1.15 of the
# first and was not off in about a third of its cold starts; its prompt look, 32 rows through
# its quantized output layer, then cost 6-9 plain steps before LOOKED_DRAFT_OFF switched it
# off anyway (docs/benchmarks.md, "Two free signals").
FIRST_STEP_DISCOUNTED = True  # False: the first step undivided (the negative control of a test)
FIRST_STEP_SLOWER = 1.16
# While a host search's matches hold (a copy task: lookup kept most of what it proposed in this
# reply, and last proposed within MATCH_GAP_TOKENS tokens), a paid source's first rounds wait:
# the plain steps meanwhile stop as soon as the search finds its next match. On the float16
# copy task the draft's first rounds came in a gap between two matches, two k = 1 rounds,
# both rejected, at two plain steps each (the defaults 2.93x plain against lookup alone's
# 3.09x). A paid source that has had its first rounds drafts in such gaps as always.
WAIT_FOR_MATCH = True  # False: the old rule (the negative control of a test)
MATCH_GAP_TOKENS = 8
MATCH_RECORD = 0.75  # the host search's acceptance estimate, after two rounds or more
# A host search's proposal kept whole is followed by one at least twice as long (up to its cap):
# a match that held says more about the text ahead than the per-draft acceptance model credits
# it with, which grows k a few tokens a round while the prior and the decay let go, each round
# paying the verify pass's fixed part again (the float16 copy task on the AMD EPYC ran at
# 2.77-2.85x plain, lookup alone no faster: bench/results/copy-held-out-openblas-amd.md). A
# failed round ends the doubling (its next length is the model's again), and so does any token
# decoded by other means (a match found after them is a new one). Paired, 9 repeats: the copy
# task 1.03-1.04x on five float16 pairs and 1.04-1.05x on float32 with netlib; ordinary prompts
# at T = 0 1.01-1.06x and 1.02-1.03x; float32 with OpenBLAS, whose verify is nearly flat,
# 0.97-1.03x (bench/results/match-doubles-*-amd.md; docs/benchmarks.md).
MATCH_DOUBLES = True  # False: the model's k alone (the negative control of a test)
# ... and "twice as long" is counted in time: the next proposal is the longest whose verify
# costs at most twice the one kept whole (the source's own fit t(k)), at least twice as long.
# Where a verify pass is nearly flat in k (float32 with OpenBLAS; a GPU) a match that held
# reaches the cap a round or two sooner than by 4, 8, 16, 32, each round paying the fixed part
# again; where it is proportional to k (netlib) it is about the doubling above. Paired, 9
# repeats, AMD EPYC: the copy task 1.05-1.11x (float32, OpenBLAS), 1.03-1.05x (float16),
# 1.00-1.01x (netlib); ordinary prompts at T = 0 0.96-1.05x (OpenBLAS; the 0.96x, noisy-f32,
# read 1.03x in 21 repeats), 1.00-1.04x, 1.00x (bench/results/match-time-doubles-*-amd*.md).
MATCH_TIME_DOUBLES = True  # False: twice the tokens (the negative control of a test)
# At T > 0 a round's kept count is mostly the rule's coin flips: one k = 1 round says 0 or 1
# whether the source keeps 85% or 50% of its drafts. Its acceptance is learned instead from
# each draft's chance of being kept given the drafts before it (sum_x min(p, q), read in the
# round's one sync: loop._judge): expected kept drafts and the chance of a rejection in place
# of the counts (the same mean, far less noise).
SOFT_ACCEPTANCE = True  # False: the counts (the negative control of a test)
EXPLORE_EVERY = 6  # every so often try a longer or shorter k to keep the cost fit honest
PRIOR_ROUNDS = 1.0  # a calibration weighs as much as this many rounds at each of three k
FIRST_LOOKUP_TOKENS = 8  # lookup's first length with no calibration
BLOCK_FIRST_FROM_BLOCK = False  # True: a block drafter's first rounds from its block (before)
DEFAULT_ACCEPTANCE_PRIOR = 0.75  # per-draft acceptance before any round (greedy)
FREE_SOURCES = ("lookup", "suffix")  # host searches: their proposals cost no draft steps
SAMPLING_ACCEPTANCE_PRIOR = 0.5  # at temperature > 0 drafts are accepted less often


class DraftPolicy(Protocol):
    def proposal_length(self, source: str) -> int: ...
    def plain_steps(self) -> int: ...
    def observe(self, round_, seconds: Optional[float]) -> None: ...
    def describe(self) -> dict: ...


def trial_steps() -> int:
    """The cold start's plain trial, its first step included (STEADY_PLAIN_STEPS: longer)."""
    return PLAIN_TRIAL_STEPS if STEADY_PLAIN_STEPS else SHORT_TRIAL_STEPS


class FixedPolicy:
    """Always draft k tokens, from every source (mlx-lm's behaviour)."""

    def __init__(self, num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}.")
        self.k = num_draft_tokens

    def proposal_length(self, source: str) -> int:
        return self.k

    def num_draft_tokens(self) -> int:
        return self.k

    def plain_steps(self) -> int:
        return PLAIN_BLOCK  # only when no source proposes (lookup found nothing)

    def observe(self, round_, seconds: Optional[float]) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": "fixed", "k": self.k, "calibrated": None}  # no policy to calibrate


class SourceEstimate:
    """One drafting source: decayed acceptance, seconds per round t(k), and its off switch.

    - acceptance a: accepted / (accepted + rejections), the i.i.d. MLE;
    - t(k) = t0 + t1 * k, least squares over its rounds (a calibration seeds it);
    - off: tokens still to decode without it, the next off period, probe rounds left.
    """

    def __init__(self, k_max: int, k_initial: int, decay: float, acceptance: float = 0.75,
                 weight: float = 4.0, first: tuple = FIRST_FRACTIONS):
        self.k_max, self.k_initial, self.decay = k_max, min(k_initial, k_max), decay
        self.k = self.k_initial
        self.prior_acceptance = acceptance  # measured by a calibration, or a guess
        self.accepted, self.rejected = acceptance * weight, (1.0 - acceptance) * weight
        self.fit = [0.0] * 5  # decayed sums of 1, k, k^2, t, k*t
        self._best = None  # best_k() until the estimates change
        self.rounds = 0
        self.warm = False  # a calibration gave the fit a slope: no first-rounds schedule
        self.prior_judged = False  # whether the calibration alone was asked if it loses
        self.off_left = 0
        self.off_steps = FIRST_OFF_STEPS
        self.first = first  # the fractions of k_initial its first rounds draft
        self.probe_left = len(first) - 1
        self.since = 0  # tokens decoded without it since its last round
        self.switched_off = 0
        self.losing = False  # the last verdict found it slower than plain (by OFF_MARGIN)
        self.probing = False  # switched off, and not yet probed again
        self.little_to_win = False  # its last off period was long: even its prior hardly wins
        self.soft = False  # its last round came with each draft's chance (T > 0)
        self.looked = False  # its acceptance started from the prompt look's
        self.look_ceiling: Optional[float] = None  # greedy: the most the look allows (GREEDY_LOOK)
        self.first_own: Optional[float] = None  # its first round's own acceptance, from chances
        self.held = 0  # a host search's last proposal, when it was kept whole (MATCH_DOUBLES)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def add(self, k: int, seconds: float, weight: float = 1.0) -> None:
        d = self.decay if weight == 1.0 else 1.0
        row = (1.0, k, k * k, seconds, k * seconds)
        self.fit = [d * s + weight * x for s, x in zip(self.fit, row)]
        self._best = None

    def seconds(self, k: int) -> Optional[float]:
        n, sk, skk, st, skt = self.fit
        if n < 1e-9:
            return None
        var = skk / n - (sk / n) ** 2
        if var <= 1e-9:  # one k seen so far: assume cost proportional to k + 1
            return (st / n) * (k + 1) / (sk / n + 1)
        # A slope <= 0 is noise around a flat cost (a GPU's verify pass): use a
        # flat t(k), never one that makes a plain step look cheaper than it is.
        slope = max((skt / n - sk * st / n**2) / var, 0.0)
        return st / n + slope * (k - sk / n)

    def rate(self, k: int, acceptance: Optional[float] = None) -> Optional[float]:
        """Expected tokens per second drafting k (at `acceptance`, by default its own)."""
        seconds = self.seconds(k)
        if not seconds or seconds <= 0:
            return None
        a = self.acceptance if acceptance is None else acceptance
        return expected_tokens_per_round(a, k) / seconds

    def best_k(self) -> int:
        """argmax_k rate(k); kept until the estimates change (asked every round, up to 32 k)."""
        if self._best is None:
            rates = {k: self.rate(k) for k in range(1, self.k_max + 1)}
            if any(r is None for r in rates.values()):
                return self.k
            self._best = max(rates, key=rates.get)
        return self._best

    def length(self) -> int:
        """The next round's k: its first fractions of k first (the fit gets a slope), then the
        best; at least twice a host search's last proposal when that was kept whole."""
        if not self.warm and self.rounds < len(self.first):
            k = min(max(1, int(self.k_initial * self.first[self.rounds])), self.k_max)
            return max(k, self._doubled())
        k = self.best_k()
        if self.rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            step = max(1, k // 4)
            k = k + step if (self.rounds // EXPLORE_EVERY) % 2 == 0 else k - step
        self.k = max(min(max(k, 1), self.k_max), self._doubled())
        return self.k

    def _doubled(self) -> int:
        """MATCH_DOUBLES: twice the last proposal kept whole, within the cap (0: none); with
        MATCH_TIME_DOUBLES up to the longest that costs at most twice its time."""
        if not MATCH_DOUBLES or not self.held:
            return 0
        k = min(2 * self.held, self.k_max)
        at_stake = self.seconds(self.held) if MATCH_TIME_DOUBLES else None
        while at_stake and k < self.k_max and self.seconds(k + 1) <= 2 * at_stake:
            k += 1
        return k

    def observe(self, k: int, accepted: int, seconds: Optional[float],
                catches_up: bool = False, chances: Optional[Sequence[float]] = None) -> None:
        """One round of k drafts, `accepted` of them kept, in `seconds`. With `catches_up`
        (a draft model's first round, or its first after sitting out CATCH_UP_TOKENS) the
        round also fed the tokens it missed: its time is not its k's. `chances` (T > 0): each
        draft's chance of being kept given those before it, counted in place of the flips
        (SOFT_ACCEPTANCE)."""
        if UNTIMED_CATCH_UP and catches_up and self.catching_up():
            seconds = None
        self._forget(k)
        self.rounds += 1
        kept, rejections = accepted, float(accepted < k)
        if SOFT_ACCEPTANCE and chances:
            kept, rejections = expected_kept(chances)
            if self.rounds == 1:
                self.first_own = kept / (kept + rejections) if kept + rejections else None
        self.count(kept, rejections)
        if seconds is not None:
            self.add(k, seconds)

    def count(self, kept: float, rejections: float) -> None:
        """Evidence on acceptance: drafts kept, and rejections (a round ends at its first)."""
        self.accepted = self.decay * self.accepted + kept
        self.rejected = self.decay * self.rejected + rejections
        self._best = None

    def catching_up(self) -> bool:
        """Whether this round also feeds a backlog: tokens decoded without it before its first
        rounds were done (the cold start's trial), or CATCH_UP_TOKENS of them since."""
        return self.since >= CATCH_UP_TOKENS or (self.since > FIRST_LOOK_AFTER
                                                  and self.rounds < len(self.first))

    def _forget(self, k: int) -> None:
        """Age the acceptance memory by the text decoded without this source since its last round.

        The memory decays per round; a stretch of n tokens is as much text as
        n / E[tokens per round] rounds, so it decays as if those had run. Without
        this, a hard opening (say a docstring the draft cannot guess) outvoted
        the probes that follow an off period, and speculation stayed off on text
        where it wins. The ratio accepted : rejected is kept and only its weight
        shrinks, so the probe rounds decide, and a useless draft is still judged useless.
        """
        if self.since:
            rounds = self.since / expected_tokens_per_round(self.acceptance, k)
            self.accepted *= self.decay ** rounds
            self.rejected *= self.decay ** rounds
            self.since = 0

    def passed(self, tokens: int) -> None:
        """`tokens` were decoded by other means (plain steps or another source)."""
        self.since += tokens
        self.held = 0  # a match picked up after them is a new one
        self.off_left = max(self.off_left - tokens, 0)

    def switch_off(self) -> None:
        self.off_left = self.off_steps
        self.off_steps = min(2 * self.off_steps, MAX_OFF_STEPS)
        self.probe_left = PROBE_ROUNDS - 1
        self.switched_off += 1
        self.losing = False
        self.probing = True


def expected_kept(chances: Sequence[float]):
    """(expected kept drafts, chance some draft is rejected) of a round whose drafts are kept
    with these chances, each given those before it."""
    kept, survive = 0.0, 1.0
    for chance in chances:
        survive *= chance
        kept += survive
    return kept, 1.0 - survive


class AdaptivePolicy:
    """Pick each source's k to maximise expected tokens per second; skip a source when it loses.

    Each source (draft model, prompt lookup) keeps its own estimates
    (`SourceEstimate`), because a lookup round drafts for free while a draft
    model pays per token. Each round k* = argmax_k E[tokens | a, k] / t(k)
    over 1..its k_max (the draft model's cap, or the longer lookup cap: its
    proposals cost only verify time). When even k* is slower than plain
    decoding (by more than OFF_MARGIN), the source is switched off for a block
    of tokens (32, doubling while it keeps losing, up to 256), then probed
    again for PROBE_ROUNDS rounds, so a bad draft or a machine where
    verification is not cheap costs little and a hard opening does not keep a
    good draft off.

    `prior`, a calibration of this machine (`mlx-spec tune`), seeds the cost
    fits, the plain step time and the draft's acceptance, so the first rounds
    already draft the right k or none.
    """

    def __init__(self, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 initial_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
                 decay: float = DEFAULT_DECAY, auto_off: bool = True,
                 max_lookup_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS,
                 prior: Optional[CostPrior] = None,
                 acceptance_prior: float = DEFAULT_ACCEPTANCE_PRIOR,
                 block_tokens: Optional[Dict[str, int]] = None):
        for name, value in (("max_draft_tokens", max_draft_tokens),
                            ("max_lookup_tokens", max_lookup_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        self.k_max = max_draft_tokens
        self.k_initial = min(initial_draft_tokens, max_draft_tokens)
        self.max_lookup_tokens = max_lookup_tokens
        # A block drafter's source: it drafts its whole block in one pass, so k may go up to
        # the block's length (its cap and first length), whatever max_draft_tokens says.
        self.block_tokens = dict(block_tokens or {})
        self.decay = decay
        self.auto_off = auto_off
        self.prior = prior
        self.sources: Dict[str, SourceEstimate] = {}
        self.acceptance_prior = acceptance_prior
        # Timed plain steps only: a calibrated plain step may be from another load on
        # the machine; the fits' t(0) (seeded by it, then today's rounds) follows the load.
        self.plain_time = [0.0, 0.0]  # sums of 1 and seconds over timed plain steps
        self.steady_laps: Deque[float] = deque(maxlen=STEADY_LAPS)  # (STEADY_PLAIN_STEPS)
        self._block: List[Optional[float]] = []  # the laps of the plain block under way
        # (a block opens at a round that says so, Round.opens_block, and ends at any drafted one)
        # Plain steps still to time before speculating or judging. With no calibration the
        # first tokens are decoded plainly: every later verdict compares against a timed
        # plain step, not the round-time fit's t(0), which carries the round's overhead.
        self.plain_trial = trial_steps() if prior is None and auto_off else 0
        self.elapsed = 0.0  # seconds of every timed round and plain step
        self.lost = 0.0  # speculative rounds' seconds beyond plain decoding's for their tokens
        self.catch_up_seconds: Dict[str, float] = {}  # per backlog token, by paid source
        self.draft_step_seconds: Dict[str, float] = {}  # one timed step, by paid source
        self.first_step_seconds: Optional[float] = None  # the target's first plain step

    def source(self, name: str) -> SourceEstimate:
        if name not in self.sources:
            lookup = name in FREE_SOURCES
            k_max = self.max_lookup_tokens if lookup else self.block_tokens.get(name, self.k_max)
            # A block drafter's first rounds are sized from the default k, not its block: a
            # first round of 3/4 of a 16-block verified 12 tokens (~4.5 plain steps on a CPU).
            k0 = min(FIRST_LOOKUP_TOKENS, k_max) if lookup else \
                (self.block_tokens.get(name, self.k_initial) if BLOCK_FIRST_FROM_BLOCK
                 else min(self.k_initial, k_max))
            prior = self.prior
            a = prior.acceptance.get(name) if prior is not None else None
            estimate = SourceEstimate(k_max, k0, self.decay,
                                      self.acceptance_prior if a is None else a,
                                      first=FIRST_FRACTIONS[1:] if lookup else FIRST_FRACTIONS)
            if prior is not None and prior.knows(name):
                for k in sorted({1, (1 + k_max) // 2, k_max}):
                    estimate.add(k, prior.round_seconds(name, k), PRIOR_ROUNDS)
                estimate.warm = True
                estimate.k = estimate.best_k()
                estimate.probe_left = FIRST_ROUNDS - 1  # one round at T > 0 is a coin toss
            self.sources[name] = estimate
        return self.sources[name]

    # --- what tests and reports read ---
    @property
    def k(self) -> int:
        return self.source("draft").k

    @property
    def acceptance(self) -> float:
        return self.source("draft").acceptance

    @property
    def switched_off(self) -> int:
        return sum(s.switched_off for s in self.sources.values())

    @property
    def measured_plain_seconds(self):
        if STEADY_PLAIN_STEPS and self.steady_laps:
            return statistics.median(self.steady_laps)
        n, seconds = self.plain_time
        return seconds / n if n > 0 else None

    def _time_plain_step(self, seconds: Optional[float]) -> None:
        """Add a plain step's lap (None: untimed) to its block; the lap before it, with one
        before it too, is a steady step (STEADY_PLAIN_STEPS)."""
        if seconds is not None:  # equal weights: a block's first step carries the
            # pipeline's fill and its last is short (4 steps timed 32, 17, 17, 4 ms)
            self.plain_time = [s + x for s, x in zip(self.plain_time, (1.0, seconds))]
        self._block.append(seconds)
        if len(self._block) >= 3 and self._block[-2] is not None:
            self.steady_laps.append(self._block[-2])

    @property
    def plain_seconds(self):
        """Seconds per plain step: measured, else calibrated, else a fit's t(0).

        A round with no drafts is one target pass over one token, which is a
        plain step, so the intercept of a round-time fit estimates it before
        any plain step has been timed. A calibration's own plain step comes
        first: plain steps are queued back to back, so they cost less than the
        fit's t(0), a lone unpipelined pass (which made a draft that loses by
        30% look like one that loses by 15%, and probed it within 32 tokens).
        """
        estimate = self.measured_plain_seconds
        if not estimate and self.prior is not None:
            estimate = self.prior.plain_seconds
        for source in self.sources.values():
            estimate = estimate or source.seconds(0)
        return estimate if estimate and estimate > 0 else None

    # --- the policy protocol ---
    def proposal_length(self, source: str) -> int:
        estimate = self.source(source)
        if estimate.probing and estimate.off_left == 0 and self._probe_over_budget(source, estimate):
            estimate.off_left = self._probe_wait(source)  # not yet
        if (self.plain_trial > 0 and not self._drafts_in_trial(source, estimate)) \
                or estimate.off_left > 0 or self._waits_for_match(source, estimate):
            return 0
        if self.auto_off and estimate.warm and not estimate.prior_judged:
            estimate.prior_judged = True
            judged = CALIBRATION_JUDGES_LOOKUP or source not in FREE_SOURCES
            if judged and self._loses(estimate, at_once=True):  # the calibration says it loses
                self._switch_off(estimate)
                return 0
        return estimate.length()

    def wants_prompt_look(self, greedy: bool = False) -> bool:
        """Whether the loop should measure the drafters' acceptance on the prompt (PROMPT_LOOK;
        greedy: GREEDY_LOOK; a calibration measured it, and without the off switch nothing reads
        it early)."""
        return (PROMPT_LOOK and self.auto_off and self.prior is None
                and (GREEDY_LOOK or not greedy))

    def observe_prompt_look(self, source: str, acceptance: float, rows: int,
                            greedy: bool = False) -> None:
        """The source's acceptance measured on the prompt's last `rows` positions
        (mlx_spec/prompt_look.py), in place of the guessed prior, weighing as much; `greedy`:
        the share of argmax agreements, only a ceiling for LOOKED_DRAFT_OFF (GREEDY_LOOK)."""
        estimate = self.source(source)
        if not self.wants_prompt_look(greedy) or estimate.rounds or rows < 1:
            return
        a = min(max(acceptance, 0.0), 1.0)
        if greedy:
            estimate.look_ceiling = greedy_look_ceiling(a, rows)
        else:
            weight = estimate.accepted + estimate.rejected
            estimate.prior_acceptance = a
            estimate.accepted, estimate.rejected = a * weight, (1.0 - a) * weight
        estimate.looked = True
        if self.first_step_seconds is not None:  # (the loop looks after the first round)
            self._off_if_costly()

    def observe_first_guess(self, source: str, hit: bool) -> None:
        """Greedy: whether a paid source's guess for the first token (its timed step's argmax)
        was the target's, counted as a k = 1 round's acceptance, with no time (FIRST_GUESS)."""
        estimate = self.source(source)
        if FIRST_GUESS and self.auto_off and self.prior is None and not estimate.rounds:
            estimate.count(float(hit), float(not hit))

    def still_looks(self, source: str) -> bool:
        """Whether a prompt look at `source` can still change anything: it has drafted no round
        and is not off (a draft whose step costs a target step is off after the first one)."""
        estimate = self.sources.get(source)
        return estimate is None or (estimate.rounds == 0 and estimate.off_left == 0)

    def observe_catch_up(self, source: str, tokens: int, seconds: float) -> None:
        """A paid source was fed `tokens` it had not seen (its prompt prefill) in `seconds`:
        what a probe's catch-up will cost per token. A short prompt's is mostly fixed cost."""
        if tokens >= CATCH_UP_TOKENS and seconds > 0:
            self.catch_up_seconds[source] = seconds / tokens

    def wants_draft_step(self, source: str) -> bool:
        """Whether the loop should time one step of `source` after its prefill (COSTLY_DRAFT_OFF:
        only for a cold start's first look)."""
        return (COSTLY_DRAFT_OFF and FIRST_LOOK and self.auto_off and self.prior is None
                and source not in FREE_SOURCES)

    def observe_draft_step(self, source: str, seconds: float) -> None:
        """One step of a paid source took `seconds` (timed after its prefill; None: not timed)."""
        if seconds:
            self.draft_step_seconds[source] = seconds

    def _costly(self, name: str) -> bool:
        """Whether a paid source's timed step costs at least a target step (the plain steps'
        average once any is timed, else the target's first plain step, slower than a steady one,
        divided by FIRST_STEP_SLOWER: the step before a first look is not timed as a plain
        step), or, its acceptance read by the prompt look, it loses even with a free verify pass
        (LOOKED_DRAFT_OFF)."""
        step = self.draft_step_seconds.get(name)
        target = self.measured_plain_seconds or self._steady_from_first()
        if not (COSTLY_DRAFT_OFF and step and target):
            return False
        return step >= target or self._loses_with_a_free_verify(name, step / target)

    def look_rows(self, seconds_per_token: Optional[float], tokens: int, most: int) -> int:
        """How many of the `most` rows gathered the prompt look may compare (below
        prompt_look.MIN_ROWS it takes none) when it may cost LOOK_SHARE of `tokens` plain steps, each row
        LOOK_ROW_TOKENS and the look LOOK_FIXED_TOKENS prompt tokens' prefill at the target's
        `seconds_per_token` (LOOK_BUDGET); `most` when either time is unknown."""
        step = self.steady_step_seconds()
        if not (LOOK_BUDGET and seconds_per_token and step):
            return most
        budget = LOOK_SHARE * tokens * step / seconds_per_token  # in prompt tokens
        return max(0, min(most, int((budget - LOOK_FIXED_TOKENS) / LOOK_ROW_TOKENS + 1e-9)))

    def steady_step_seconds(self) -> Optional[float]:
        """A plain step's seconds as best known now: the plain steps' average once any is
        timed, else the first step discounted (_steady_from_first), else plain_seconds."""
        return self.measured_plain_seconds or self._steady_from_first() or self.plain_seconds

    def _steady_from_first(self) -> Optional[float]:
        """A steady plain step's estimate from the target's first (FIRST_STEP_DISCOUNTED)."""
        if self.first_step_seconds is None:
            return None
        return self.first_step_seconds / (FIRST_STEP_SLOWER if FIRST_STEP_DISCOUNTED else 1.0)

    def _loses_with_a_free_verify(self, name: str, step_share: float) -> bool:
        """LOOKED_DRAFT_OFF: whether a source whose acceptance the prompt look measured stays
        below plain less OFF_MARGIN at every k with rounds of one plain step plus k draft steps
        of `step_share` of a target step each (no verify pass costs less)."""
        estimate = self.sources.get(name)
        if not (LOOKED_DRAFT_OFF and estimate is not None and estimate.looked):
            return False
        a = estimate.acceptance if estimate.look_ceiling is None else estimate.look_ceiling
        best = max(expected_tokens_per_round(a, k) / (1.0 + k * step_share)
                   for k in range(1, estimate.k_max + 1))
        return best < 1.0 - OFF_MARGIN

    def _off_if_costly(self) -> None:
        """Switch off, for its long off period, each paid source in its first rounds whose
        timed step costs too much (_costly): it cannot win, not even a look."""
        if not self.draft_step_seconds:  # nothing timed (calibrated, or no draft model)
            return
        for name, estimate in self.sources.items():
            if (estimate.rounds < FIRST_ROUNDS and estimate.off_left == 0 and not estimate.warm
                    and self._costly(name)):
                self._switch_off(estimate, little_to_win=True)

    def _catch_up_per_token(self, name: str) -> float:
        """Seconds a probe of `name` spends per backlog token (0: a host search, nothing
        measured yet, or CATCH_UP_IN_BUDGET off)."""
        if not CATCH_UP_IN_BUDGET or name in FREE_SOURCES:
            return 0.0
        return self.catch_up_seconds.get(name, 0.0)

    def _probe_over_budget(self, name: str, estimate: SourceEstimate) -> bool:
        """Whether a due probe must wait (PROBE_BUDGET): every probe after the first, and the
        first after a long off period (with CATCH_UP_IN_BUDGET), when the net loss so far plus
        the probe's predicted catch-up exceeds the budget."""
        gated = estimate.switched_off > 1 or (CATCH_UP_IN_BUDGET and estimate.little_to_win)
        return gated and (self.lost + self._catch_up_per_token(name) * estimate.since
                          > PROBE_BUDGET * self.elapsed)

    def _probe_wait(self, name: str) -> int:
        """Tokens before a probe over budget is asked about again: PLAIN_BLOCK, or the longest
        off period when its catch-up grows faster than the budget (it will not fit). Each
        plain block ends the queue of steps (~a third of a step on a CPU: 16-token blocks
        cost the sliding pair 3% over 384 tokens)."""
        plain = self.plain_seconds
        if plain and self._catch_up_per_token(name) >= PROBE_BUDGET * plain:
            return MAX_OFF_STEPS
        return PLAIN_BLOCK

    def _first_look(self, name: str, estimate: SourceEstimate, since: int = FIRST_LOOK_AFTER) -> bool:
        """Whether a paid source's first round is due in the cold start's trial (FIRST_LOOK),
        `since` tokens into it."""
        return (FIRST_LOOK and name not in FREE_SOURCES and estimate.rounds == 0
                and estimate.since == since and not estimate.warm)

    def _drafts_in_trial(self, name: str, estimate: SourceEstimate) -> bool:
        """Whether a source drafts during the cold start's trial: a paid source its first look;
        a host search (LOOKUP_IN_TRIAL) until a verdict finds it losing, and never while a
        paid source awaits its first look or its verdict."""
        if name not in FREE_SOURCES:
            return self._first_look(name, estimate)
        return LOOKUP_IN_TRIAL and not estimate.losing and not any(
            other not in FREE_SOURCES and s.off_left == 0
            and (s.rounds or s.since <= FIRST_LOOK_AFTER
                 and self._first_look(other, s, since=s.since))
            for other, s in self.sources.items())

    def _matching(self) -> Optional[SourceEstimate]:
        """The host search whose matches hold, if one does (None with WAIT_FOR_MATCH off)."""
        for name, s in self.sources.items():
            if (WAIT_FOR_MATCH and name in FREE_SOURCES and s.rounds >= 2
                    and s.acceptance >= MATCH_RECORD and s.since < MATCH_GAP_TOKENS
                    and s.off_left == 0):
                return s
        return None

    @staticmethod
    def _paid_first_rounds(name: str, estimate: SourceEstimate) -> bool:
        return name not in FREE_SOURCES and estimate.rounds < FIRST_ROUNDS

    def _waits_for_match(self, name: str, estimate: SourceEstimate) -> bool:
        """Whether a paid source's first rounds wait for a holding host search's next match."""
        return self._paid_first_rounds(name, estimate) and self._matching() is not None

    def _looks_due(self) -> bool:
        """Whether the trial's first step is next, and a first look after it."""
        return self.plain_trial > 0 and any(self._first_look(name, s, since=0)
                                            for name, s in self.sources.items())

    def num_draft_tokens(self) -> int:
        return self.proposal_length("draft")

    def plain_steps(self) -> int:
        if self.plain_trial:
            return FIRST_LOOK_AFTER if self._looks_due() else self.plain_trial
        steps = min((s.off_left for s in self.sources.values() if s.off_left > 0),
                    default=PLAIN_BLOCK)
        matching = self._matching()
        if matching is not None and any(self._paid_first_rounds(name, s)
                                        for name, s in self.sources.items()):
            steps = min(steps, MATCH_GAP_TOKENS - matching.since)  # then the first rounds
        return steps

    def observe(self, round_, seconds: Optional[float]) -> None:
        tokens = len(round_.tokens)
        if round_.num_drafted == 0 and self.first_step_seconds is None:
            self.first_step_seconds = seconds  # set against a draft's timed step (_costly)
        if self._looks_due() and not round_.num_drafted:  # the step before a first look: a
            # block of one, just after the prefill freed its buffers (8 ms against 4 on the
            # mtp-f32 pair). A copy task's lookup round in its place is timed: untimed, lookup's
            # fit had one k, took cost as proportional to k + 1 and proposed 1 token a round.
            seconds = None
        if seconds is not None:
            self.elapsed += seconds
            if round_.num_drafted and self.plain_seconds:
                self.lost += seconds - tokens * self.plain_seconds
        for name, estimate in self.sources.items():
            if name != round_.source:
                estimate.passed(tokens)
        if round_.num_drafted == 0:
            if getattr(round_, "opens_block", False):
                self._block = []
            self._time_plain_step(seconds)
            if self.plain_trial == 1:
                self._judge_first_looks()
            self.plain_trial = max(self.plain_trial - 1, 0)
            self._off_if_costly()
            return
        self._block = []  # a round ends any plain block
        estimate = self.source(round_.source)
        estimate.probing = False
        if (seconds is not None and round_.source not in FREE_SOURCES
                and estimate.since >= CATCH_UP_TOKENS):  # it fed a backlog: at what cost
            steady = estimate.seconds(round_.num_drafted)
            if steady:
                self.catch_up_seconds[round_.source] = max(seconds - steady, 0.0) / estimate.since
        estimate.soft = bool(getattr(round_, "chances", None))
        estimate.observe(round_.num_drafted, round_.num_accepted, seconds,
                         catches_up=round_.source not in FREE_SOURCES,
                         chances=getattr(round_, "chances", None))  # (batch rows: none)
        whole = round_.source in FREE_SOURCES and round_.num_accepted == round_.num_drafted
        estimate.held = round_.num_drafted if whole else 0
        self._judge(estimate, match_held=MATCH_HOLDS and whole)

    def _predicted_ratio(self, estimate: SourceEstimate,
                         acceptance: Optional[float] = None) -> Optional[float]:
        """The source's best predicted tokens/s over plain decoding's (None: not known yet)."""
        if acceptance is None:
            best = estimate.rate(estimate.best_k())
        else:
            best = max((estimate.rate(k, acceptance) or 0.0)
                       for k in range(1, estimate.k_max + 1)) or None
        if best is None or self.plain_seconds is None:
            return None
        return best * self.plain_seconds

    def _switch_off(self, estimate: SourceEstimate, little_to_win: bool = False) -> None:
        """Off for the next off period; for LONG_OFF_STEPS when even accepting as well as
        its prior says it would hardly win (a machine where verifying costs nearly as
        much as decoding, or a calibration that measured a useless draft; not a hard
        stretch of text), or `little_to_win` says so: probing costs rounds, and a draft
        model's catch-up over every token decoded meanwhile, for little to gain."""
        optimistic = max(estimate.acceptance, estimate.prior_acceptance)
        ratio = self._predicted_ratio(estimate, optimistic)
        now = self._predicted_ratio(estimate)
        evidence = (estimate.switched_off > 0 or estimate.rounds >= LONG_OFF_EVIDENCE
                    or estimate.warm or (now is not None and now < 1.0 - CLEAR_LOSS))
        estimate.little_to_win = little_to_win or (
            ratio is not None and ratio < SMALL_GAIN and evidence)
        if estimate.little_to_win:
            estimate.off_steps = max(estimate.off_steps, LONG_OFF_STEPS)
        estimate.switch_off()

    def _loses(self, estimate: SourceEstimate, at_once: bool = False) -> bool:
        """Predicted slower than plain by CLEAR_LOSS, or by OFF_MARGIN twice in a row (or
        once, `at_once`: a calibration's verdict before any round)."""
        ratio = self._predicted_ratio(estimate)
        losing = ratio is not None and ratio < 1.0 - OFF_MARGIN
        twice, estimate.losing = estimate.losing and losing, losing
        return losing and (twice or at_once or ratio < 1.0 - CLEAR_LOSS)

    def _judge_first_looks(self) -> None:
        """At the end of the trial: a source whose first look, against the plain steps just
        timed, is HOPELESS goes off before it catches up on them."""
        if not self.auto_off:
            return
        for estimate in self.sources.values():
            if estimate.rounds and estimate.off_left == 0 and not estimate.warm \
                    and self._hopeless(estimate):
                self._switch_off(estimate)

    def _hopeless(self, estimate: SourceEstimate) -> bool:
        """Whether a source in its first rounds goes off without the rest: predicted below
        HOPELESS, unable to win at any k (_cannot_win), or (with FIRST_ROUNDS_OPTIMISTIC)
        slower than plain by CLEAR_LOSS even at the better of its acceptance and its prior."""
        own = estimate.first_own if (HOPELESS_FIRST_OWN and estimate.rounds == 1
                                     and not estimate.looked) else None
        ratio = self._predicted_ratio(estimate, None if own is None
                                      else max(estimate.acceptance, own))
        if ratio is not None and ratio < HOPELESS:
            return True
        if self._cannot_win(estimate):
            return True
        if not FIRST_ROUNDS_OPTIMISTIC:
            return False
        optimistic = self._predicted_ratio(
            estimate, max(estimate.acceptance, estimate.prior_acceptance))
        return optimistic is not None and optimistic < 1.0 - CLEAR_LOSS

    def _cannot_win(self, estimate: SourceEstimate) -> bool:
        """Whether, at its acceptance estimate, no k would make the source faster than plain
        less OFF_MARGIN (CANNOT_WIN_OFF; only with chances, T > 0), even with a verify pass
        that costs no more for k + 1 tokens than for 2: a round of k then costs its timed
        k = 1 round plus k - 1 more draft steps (DRAFT_STEPS_IN_BOUND: each its timed step, once
        the prompt look measured its acceptance; else none, and the bound is 1 / (1 - a) tokens
        a round of t(1))."""
        if not (CANNOT_WIN_OFF and estimate.soft) or estimate.acceptance >= 1.0:
            return False
        round_seconds, plain = estimate.seconds(1), self.plain_seconds
        if not round_seconds or not plain:
            return False
        if not DRAFT_STEPS_IN_BOUND or (DRAFT_STEPS_NEED_LOOK and not estimate.looked):
            most_tokens = 1.0 / (1.0 - estimate.acceptance)
            return most_tokens * plain / round_seconds < 1.0 - OFF_MARGIN
        step = next((self.draft_step_seconds.get(name, 0.0)
                     for name, s in self.sources.items() if s is estimate), 0.0)
        best = max(expected_tokens_per_round(estimate.acceptance, k)
                   / (round_seconds + (k - 1) * step) for k in range(1, estimate.k_max + 1))
        return best * plain < 1.0 - OFF_MARGIN

    def _judge(self, estimate: SourceEstimate, match_held: bool = False) -> None:
        """A verdict after a round (the first rounds: only a hopeless one); `match_held`: a host
        search kept its whole proposal (MATCH_HOLDS)."""
        if not self.auto_off or not self.plain_seconds:
            return
        if estimate.probe_left > 0:
            estimate.probe_left -= 1
            if (self.measured_plain_seconds and not self.plain_trial  # (a first look is
                    and self._hopeless(estimate)):  # judged at the trial's end)
                self._switch_off(estimate)  # no need to see the remaining first rounds
            return
        if match_held and (self._predicted_ratio(estimate, 1.0) or 0.0) > 1.0:
            return  # its match holds, and a holding match wins: no verdict on this round
        if not self._loses(estimate):
            estimate.off_steps = FIRST_OFF_STEPS
        elif self.measured_plain_seconds is None and not estimate.warm:
            # The verdict rests on the fit's extrapolated t(0), which timing noise
            # easily halves: time a few real plain steps, then judge again (a
            # calibrated fit measured t(0): no trial).
            self.plain_trial = trial_steps()
        else:
            self._switch_off(estimate)

    def describe(self) -> dict:
        return {
            "policy": "adaptive", "calibrated": self.prior is not None,
            "k": {name: s.k for name, s in self.sources.items()},
            "acceptance_estimate": {name: round(s.acceptance, 3)
                                    for name, s in self.sources.items()},
            "switched_off": self.switched_off,
            "plain_seconds": self.plain_seconds,
        }


def greedy_look_ceiling(agreement: float, rows: int) -> float:
    """The per-draft acceptance a greedy look's `agreement` over `rows` positions allows at most
    (GREEDY_LOOK): its odds, half a match added to the count and half a miss, times
    GREEDY_LOOK_ODDS. No agreement on the greedy look's 16 rows allows 0.11, 2 of 16 0.41,
    4 of 16 0.59, 8 of 16 0.8."""
    a = (agreement * rows + 0.5) / (rows + 1.0)
    odds = GREEDY_LOOK_ODDS * a / (1.0 - a)
    return odds / (1.0 + odds)


def make_policy(num_draft_tokens=None, adaptive=None, max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS,
                auto_off=True, prior: Optional[CostPrior] = None,
                max_lookup_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS,
                acceptance_prior: float = DEFAULT_ACCEPTANCE_PRIOR,
                block_tokens: Optional[Dict[str, int]] = None):
    """A pinned k gives FixedPolicy; otherwise the default policy. The arguments were checked
    where they entered (`check_arguments`); the policies check only what they are built with."""
    if adaptive is None:
        adaptive = num_draft_tokens is None and DEFAULT_ADAPTIVE
    if adaptive:
        initial = num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
        return AdaptivePolicy(max_draft_tokens, initial, auto_off=auto_off,
                              max_lookup_tokens=max_lookup_tokens, prior=prior,
                              block_tokens=block_tokens,
                              acceptance_prior=acceptance_prior)
    return FixedPolicy(num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
