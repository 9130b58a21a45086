"""How many tokens each drafting source proposes per round: a model of tokens per second.

A policy answers `proposal_length(source)` before each round (0: do not ask that source;
"draft" is the draft model, "lookup" prompt lookup, "suffix" suffix drafting, "mtp", "dflash",
"eagle3" the heads), decodes plainly for `plain_steps()` steps when no source proposes, and is
told every finished round via `observe(round, seconds)`: the seconds the loop timed (a policy
keeps no clock, so a sharded target can hand every rank rank 0's times). Policies only choose
lengths; exactness never depends on them.

The adaptive policy is one formula (docs/drafting.md, "The policy"). For source s and length k

    rate_s(k) = E_s(k) / T_s(k),   E_s(k) = 1 + sum_{i<=k} prod_{j<=i} a_s,j,   rate_plain = 1 / t_plain

- a_s, the source's per-draft acceptance: decayed counts of kept drafts and rejections (at
  T > 0 each draft's chance of being kept, the counts' mean with less noise), from a prior worth
  PRIOR_ACCEPTANCE_ROUNDS rounds: a calibration's, the prompt look's, or a guess; a_s,j, the
  chance of keeping draft j given those before it: each depth's own counts, shrunk to a_s by
  DEPTH_PRIOR_ROUNDS (with one a for every depth, E_s(k) = (1 - a^(k+1)) / (1 - a)).
- T_s(k), seconds of a round drafting k: a decayed least-squares line over the source's timed
  rounds, shrunk to a prior line worth PRIOR_COST_ROUNDS rounds that fades as rounds come in
  (its slope a ridge estimate): a calibration's rounds, else t_plain + k v + D_s(k), with v what
  one more verified token costs: the host searches' timed chain rounds' (less t_plain, per
  draft), shrunk to the target's prefill seconds per token by VERIFY_PRIOR_ROUNDS; D_s(k) the source's
  timed step times k (0 for a host search; one step whatever k for a block drafter). A round
  that also fed the source tokens it missed has that catch-up (per token: its prefill's)
  taken off first.
- t_plain: the median of the recent steady plain steps (laps with a lap before and after them
  in their block); a calibration's until one is timed. With neither, the first TRIAL_STEPS
  tokens are plain.

A source that can propose token trees (a draft model, an MTP, EAGLE-3 or DFlash drafter;
drafters/tree.py) also has a width w:
a spine of k drafts with w - 1 sibling leaves beside each spine node, k w nodes verified:

    E_s(k, w) = 1 + sum_{i<=k} prod_{j<i} a_s,j (a_s,i + (1 - a_s,i) b_s,w),   T_s(k) + (w - 1) k v_s

- b_s,w = 1 - (1 - beta_s)^(w - 1), the chance a sibling is kept where the spine's draft was
  rejected, from beta_s, one sibling's: decayed counts of siblings kept and tried in tree
  rounds, shrunk to SIBLING_PRIOR by SIBLING_PRIOR_ROUNDS; b_s,1 = 0 (a chain). A tree's
  nodes beyond its depth cost v_s each: its tree rounds' seconds beyond the line at their
  depth, per extra node, decayed and shrunk by PRIOR_COST_ROUNDS to v (the calibration's
  verify curve, else v above); T_s stays the line over depth, a
  tree round timed into it less its extra nodes.
  A tree one wider than the chosen shape is tried only while it could beat that shape and
  plain decoding with SIBLING_HOPE per sibling: where verifying k w nodes costs about k w
  single passes (a CPU), never. Trials come EXPLORE_EVERY rounds apart, the gap doubling
  after each trial that kept no sibling (up to MAX_OFF_STEPS rounds), reset by one that did.

Each round source s drafts k* = argmax_k rate_s(k) when rate_s(k*) t_plain >= 1 - OFF_MARGIN.
Otherwise it sits out an off period (FIRST_OFF_STEPS tokens, doubling while it keeps losing,
up to MAX_OFF_STEPS), then drafts PROBE_ROUNDS probe rounds. Exploration is explicit and
bounded: a host search drafts one round before any verdict, a paid source PROBE_ROUNDS
rounds, as a probe does; a first round or probe happens only when what it would save over
the next PROBE_HORIZON tokens (no more than the reply has left, where the loop says how
many it may take: `expect_reply`), at the better of its estimate and its prior (the
calibration's, the prompt look's or the guess), outweighs the
round's predicted loss plus its catch-up (a draft model fed the tokens it missed), once its
costs were measured with no calibration (a paid source: its step and the prefill; a host
search: its probes only, once a timed round gave v; its first round in a request is its
verdict) or a calibration knows the source; every EXPLORE_EVERY-th round tries k* +- a quarter, so the
line's slope stays measured; from the second off period on, a probe waits while the probes'
net loss against plain decoding plus its own predicted loss exceeds PROBE_BUDGET of the time
decoded; a source that would lose even with every draft kept is never probed.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Dict, List, Optional, Protocol, Sequence

from .costmodel import CostPrior, expected_tokens_per_round
from .defaults import (DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_LOOKUP_TOKENS,
                       DEFAULT_NUM_DRAFT_TOKENS)

DEFAULT_DECAY = 0.9  # weight of the past in the online estimates, per round
DEFAULT_ACCEPTANCE_PRIOR = 0.75  # per-draft acceptance before any round (greedy)
SAMPLING_ACCEPTANCE_PRIOR = 0.5  # at temperature > 0 drafts are accepted less often
PRIOR_ACCEPTANCE_ROUNDS = 4.0  # the acceptance prior weighs as much as this many rounds
DEPTH_PRIOR_ROUNDS = 2.0  # a depth's own chance is shrunk to the pooled one by this many rounds
PRIOR_COST_ROUNDS = 2.0  # each prior point of T_s(k) weighs this many rounds, then fades
FREE_SOURCES = ("lookup", "suffix")  # host searches: their proposals cost no draft steps
TRIAL_STEPS = 4  # plain steps timed first when no calibration gives t_plain
PLAIN_BLOCK = 16  # plain steps queued back to back while no source proposes
OFF_MARGIN = 0.05  # a source is off when predicted this much slower than plain
FIRST_OFF_STEPS = 32  # tokens decoded without a source after a verdict against it
MAX_OFF_STEPS = 256
PROBE_ROUNDS = 2  # rounds a probe drafts before the next verdict (one k = 1 round is a coin flip)
EXPLORE_EVERY = 6  # every sixth round of a source tries a longer or shorter k
PROBE_BUDGET = 0.02  # share of the decoding time probes may lose
PROBE_HORIZON = 256  # tokens a probe's verdict decides about (the longest off period)
CATCH_UP_TOKENS = 16  # a backlog this long is timed as a catch-up, not as its round
STEADY_LAPS = 64  # the recent steady plain laps t_plain is the median of
UNKNOWN_VERIFY_SHARE = 0.5  # v / t_plain when no prefill was timed (a one-token prompt)
VERIFY_PRIOR_ROUNDS = 1.0  # the prefill's v weighs as much as one timed round's
UNKNOWN_STEP_SHARE = 0.3  # a paid source's step / t_plain when none was timed
LOOK_SHARE = 0.02  # the prompt look may cost this share of the reply's plain time ...
LOOK_FIXED_TOKENS = 8.0  # ... at this many prompt tokens' prefill
LOOK_ROW_TOKENS = 0.4  # ... plus this many a row (bench/results/look-rows-cost-*.md)
SIBLING_PRIOR = 0.2  # the guessed chance one sibling is kept where the spine's draft was not
SIBLING_HOPE = 0.5  # ... and the hopeful one a wider tree is tried for
SIBLING_PRIOR_ROUNDS = 2.0  # the sibling guess weighs as much as this many tree rounds


class DraftPolicy(Protocol):
    def proposal_length(self, source: str) -> int: ...
    def plain_steps(self) -> int: ...
    def observe(self, round_, seconds: Optional[float]) -> None: ...
    def describe(self) -> dict: ...


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


def expected_kept(chances: Sequence[float]):
    """(expected kept drafts, chance some draft is rejected) of a round whose drafts are kept
    with these chances, each given those before it."""
    kept, survive = 0.0, 1.0
    for chance in chances:
        survive *= chance
        kept += survive
    return kept, 1.0 - survive


def survivals(k: int, accepted: int, chances: Optional[Sequence[float]] = None) -> list:
    """Per depth j = 1..k: (the chance the round reached draft j, the chance it kept it), from
    each draft's chance given those before it (T > 0) or the kept count (greedy)."""
    out, survive = [], 1.0
    for j in range(1, k + 1):
        kept = survive * chances[j - 1] if chances and j <= len(chances) else float(j <= accepted)
        out.append((survive, kept))
        survive = kept
    return out


def at(line: tuple, k: int) -> float:
    """A cost line (k0, T at k0, slope: SourceEstimate.line) at k: T_s(k), at least 1e-9."""
    k0, t0, slope = line
    return max(t0 + slope * (k - k0), 1e-9)


class SourceEstimate:
    """One source's a_s and T_s(k), and where it stands: on, off for some tokens, or due a probe."""

    def __init__(self, k_max: int, acceptance: float, decay: float, free: bool, block: bool):
        self.k_max, self.decay, self.free, self.block = k_max, decay, free, block
        self.accepted = acceptance * PRIOR_ACCEPTANCE_ROUNDS
        self.rejected = (1.0 - acceptance) * PRIOR_ACCEPTANCE_ROUNDS
        # the prior in those counts, and its weight left in them (decayed as they are)
        self.prior, self.prior_left = acceptance, PRIOR_ACCEPTANCE_ROUNDS
        self.depths = [[0.0, 0.0] for _ in range(k_max + 1)]  # j >= 1: decayed kept, reached
        self.fit = [0.0] * 5  # decayed sums of 1, k, k^2, t, k t over timed rounds
        self.prior_weight = PRIOR_COST_ROUNDS  # the prior line's, in rounds; fades with each
        self.k = 0  # the last length chosen
        self.rounds = 0
        self.looked = False  # a prompt look set its acceptance
        self.off_left = 0  # tokens still to decode without it
        self.off_steps = FIRST_OFF_STEPS  # its next off period
        # probe rounds still to draft before the next verdict: a paid source's first try is
        # a probe's (its first draft after a prompt is often its hardest; one k = 1 round is
        # a coin flip); a host search's first round is its verdict
        self.probing = 0 if free else PROBE_ROUNDS
        self.switched_off = 0
        self.since = 0  # tokens decoded without it since its last round
        self.max_width = 1  # the widest token tree it may propose (1: chains only)
        self.width = 1  # the width last chosen
        self.siblings = [0.0, 0.0]  # decayed siblings kept and siblings tried
        self.nodes = [0.0, 0.0]  # decayed tree rounds and their extra nodes' seconds per node
        self.widen_every = EXPLORE_EVERY  # rounds between two trials of a wider tree
        self.widen_at = EXPLORE_EVERY // 2  # the round of the next one
        self.widening = False  # the round under way is such a trial

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def count(self, kept: float, rejections: float, survivals: Sequence = ()) -> None:
        """A round's evidence: drafts kept and rejections (pooled), and per depth j the chance
        the round reached draft j and kept it (`survivals`: (reached, kept) for j = 1, 2, ...)."""
        self.accepted = self.decay * self.accepted + kept
        self.rejected = self.decay * self.rejected + rejections
        self.prior_left *= self.decay
        for depth in self.depths:
            depth[0] *= self.decay
            depth[1] *= self.decay
        for j, (reached, kept_j) in enumerate(survivals[:self.k_max], 1):
            self.depths[j][0] += kept_j
            self.depths[j][1] += reached

    def count_chain(self, drafted: int, kept: int, chances: Optional[Sequence[float]] = None
                    ) -> None:
        """A chain round that kept `kept` of its `drafted` drafts; at T > 0 with each draft's
        chance of being kept (`chances`) the counts are their expectation (less noise)."""
        evidence = expected_kept(chances) if chances else (kept, float(kept < drafted))
        self.count(*evidence, survivals(drafted, kept, chances))

    def expected_tokens(self, k: int) -> float:
        """E_s(k) = 1 + sum_i prod_{j <= i} a_s,j: the chance of keeping draft j given those
        before it, each depth's own (a match that held says more of the next draft than the
        first did) shrunk to the pooled a_s by DEPTH_PRIOR_ROUNDS."""
        total, survive = 1.0, 1.0
        for j in range(1, k + 1):
            survive *= self.chance_at(j)
            total += survive
        return total

    def chance_at(self, j: int) -> float:
        """a_s,j: depth j's own counts shrunk to the pooled a_s by DEPTH_PRIOR_ROUNDS."""
        kept, reached = self.depths[j]
        return (kept + DEPTH_PRIOR_ROUNDS * self.acceptance) / (reached + DEPTH_PRIOR_ROUNDS)

    def sibling_chance(self, width: int, optimistic: bool = False) -> float:
        """b_s,w = 1 - (1 - beta_s)^(w - 1): the chance one of a node's w - 1 siblings is kept
        where the spine's draft was rejected, beta_s one sibling's: its tree rounds' counts
        shrunk to SIBLING_PRIOR (optimistic: SIBLING_HOPE, whatever the counts say)."""
        if width <= 1:
            return 0.0
        if optimistic:
            beta = SIBLING_HOPE
        else:
            kept, tried = self.siblings
            beta = (kept + SIBLING_PRIOR_ROUNDS * SIBLING_PRIOR) / (tried + SIBLING_PRIOR_ROUNDS)
        return 1.0 - (1.0 - beta) ** (width - 1)

    def count_siblings(self, width: int, kept: bool) -> None:
        """A tree round whose spine's draft was rejected where `width` - 1 siblings stood:
        one of them kept (counted as one tried), or all rejected."""
        self.siblings = [self.decay * self.siblings[0] + float(kept),
                         self.decay * self.siblings[1] + (1.0 if kept else width - 1.0)]

    def node_seconds(self, prior: float) -> float:
        """v_s: what one more verified node costs: its tree rounds' (each round's seconds less
        the line's at its depth, per node beyond the depth), shrunk to `prior` by
        PRIOR_COST_ROUNDS rounds."""
        rounds, total = self.nodes
        return (total + PRIOR_COST_ROUNDS * prior) / (rounds + PRIOR_COST_ROUNDS)

    def count_nodes(self, extra: int, seconds: float, at_depth: float) -> None:
        self.nodes = [self.decay * self.nodes[0] + 1.0,
                      self.decay * self.nodes[1] + max(seconds - at_depth, 0.0) / extra]

    def add(self, k: int, seconds: float) -> None:
        self.fit = [self.decay * s + x for s, x in zip(self.fit, (1.0, k, k * k, seconds,
                                                                 k * seconds))]
        self.prior_weight *= self.decay

    def seconds(self, k: int, prior_line: Optional[tuple]) -> Optional[float]:
        """T_s(k): its timed rounds' line, the prior line (intercept, slope) shrinking it."""
        line = self.line(prior_line)
        return None if line is None else at(line, k)

    def line(self, prior_line: Optional[tuple]) -> Optional[tuple]:
        """T_s as (its mean round's k, T_s there, slope) for `at`: its timed rounds' line, the
        prior line (intercept, slope) shrinking it; None while neither says anything. The
        slope is a ridge estimate pulled to the prior's, which fades as rounds come in: rounds
        at one k alone say nothing of it (exploration's rounds at other k do)."""
        n, sk, skk, st, skt = self.fit
        w = self.prior_weight
        if prior_line is None:
            if n < 1e-9:
                return None
            prior_line, w = (0.0, (st / n) / (sk / n + 1)), 0.0  # none: proportional to k + 1
        base, slope0 = prior_line
        if n < 1e-9:
            return 0, base, slope0
        k_mean, t_mean = sk / n, st / n
        sxx, sxy = skk - n * k_mean ** 2, skt - n * k_mean * t_mean
        slope = max((sxy + w * slope0) / (sxx + w), 0.0) if sxx + w > 1e-9 else slope0
        at_mean = (n * t_mean + w * (base + slope0 * k_mean)) / (n + w)  # its mean round, shrunk
        return k_mean, at_mean, slope

    def forget(self, k: int) -> None:
        """Age the acceptance memory by the text decoded without it (as many rounds as that text
        would have taken): a hard opening must not outvote the rounds after an off period."""
        if self.since:
            rounds = self.since / expected_tokens_per_round(self.acceptance, k)
            self.accepted *= self.decay ** rounds
            self.rejected *= self.decay ** rounds
            self.prior_left *= self.decay ** rounds
            for depth in self.depths:
                depth[0] *= self.decay ** rounds
                depth[1] *= self.decay ** rounds

    def reprior(self, acceptance: float) -> None:
        """Put `acceptance` in the prior's place, at the weight the prior has left: the counts
        are then those this prior would have given after the same rounds (a measured prior,
        the prompt look, arriving after a round)."""
        shift = (acceptance - self.prior) * self.prior_left
        self.accepted, self.rejected = self.accepted + shift, self.rejected - shift
        self.prior = acceptance

    def passed(self, tokens: int) -> None:
        self.since += tokens
        self.off_left = max(self.off_left - tokens, 0)

    def switch_off(self) -> None:
        self.off_left = self.off_steps
        self.off_steps = min(2 * self.off_steps, MAX_OFF_STEPS)
        self.probing = PROBE_ROUNDS
        self.switched_off += 1


class AdaptivePolicy:
    """argmax over sources' lengths of predicted tokens per second, plain decoding included.

    `prior`, a calibration of this machine (`mlx-spec tune`), gives t_plain, the paid sources'
    acceptance and the cost lines' prior points; without one the loop hands in the target's
    prefill time per token (`observe_prefill`) and one timed step of each paid source
    (`observe_draft_step`), and the first TRIAL_STEPS tokens time plain steps.
    """

    def __init__(self, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 initial_draft_tokens: Optional[int] = None,
                 decay: float = DEFAULT_DECAY, auto_off: bool = True,
                 max_lookup_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS,
                 prior: Optional[CostPrior] = None,
                 acceptance_prior: float = DEFAULT_ACCEPTANCE_PRIOR,
                 block_tokens: Optional[Dict[str, int]] = None):
        for name, value in (("max_draft_tokens", max_draft_tokens),
                            ("max_lookup_tokens", max_lookup_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        self.k_max, self.max_lookup_tokens = max_draft_tokens, max_lookup_tokens
        self.initial = initial_draft_tokens  # a paid source's first k (None: the model's)
        self.block_tokens = dict(block_tokens or {})  # a block drafter's cap: its block
        self.decay, self.auto_off, self.prior = decay, auto_off, prior
        self.acceptance_prior = acceptance_prior
        self.sources: Dict[str, SourceEstimate] = {}
        self.steady_laps: Deque[float] = deque(maxlen=STEADY_LAPS)
        self.plain_time = [0.0, 0.0]  # count and seconds of timed plain steps
        self._block: List[Optional[float]] = []  # the laps of the plain block under way
        self.plain_trial = TRIAL_STEPS if prior is None else 0
        self.verify_per_token: Optional[float] = None  # the target's prefill, per token
        self.verify_rounds = [0.0, 0.0]  # decayed count and sum of timed rounds' v
        self.prompt_tokens = 0  # the prompt the target prefilled (a lazy draft's backlog)
        self.step_seconds: Dict[str, float] = {}  # one timed step, by paid source
        self.catch_up_seconds: Dict[str, float] = {}  # per backlog token, by paid source
        self.elapsed = 0.0  # seconds of every timed round and plain step
        self.lost = 0.0  # probe rounds' seconds beyond plain decoding's for their tokens
        self._best: Dict[tuple, tuple] = {}  # best() until what it reads changes
        self.fallbacks: Dict[str, tuple] = {}  # a source asked only while these sit out
        self._aside: set = set()  # fallbacks that stood aside when last asked
        self.reply_left: Optional[int] = None  # tokens the reply may still take (expect_reply)

    def next_request(self, acceptance_prior: Optional[float] = None,
                     prior: Optional[CostPrior] = None) -> "AdaptivePolicy":
        """A policy for the next request of the same models: what this one measured of the
        machine (`learn_machine`), nothing of its text (acceptance, off periods) nor of its
        set-up (fallbacks); `acceptance_prior`: the request's own (its sampling's), else
        this one's; `prior`: the request's calibration (a calibration's acceptance is its
        sampling's), None for none."""
        fresh = AdaptivePolicy(self.k_max, self.initial, self.decay, self.auto_off,
                               self.max_lookup_tokens, prior,
                               self.acceptance_prior if acceptance_prior is None
                               else acceptance_prior, self.block_tokens)
        fresh.learn_machine(self)
        return fresh

    def learn_machine(self, earlier: "AdaptivePolicy") -> None:
        """Start from what `earlier`, the policy of an earlier request of the same models,
        measured of the machine: the plain steps, what a verified token and each source's step
        and catch-up cost, the sources' cost lines; nothing of its text (acceptance, off
        periods, probes, verdicts). No plain trial is then needed."""
        self._best.clear()
        self.steady_laps.extend(earlier.steady_laps)
        self.plain_time = list(earlier.plain_time)
        self.verify_per_token = earlier.verify_per_token
        self.verify_rounds = list(earlier.verify_rounds)
        self.step_seconds, self.catch_up_seconds = dict(earlier.step_seconds), dict(
            earlier.catch_up_seconds)
        for name, estimate in earlier.sources.items():
            self.source(name).fit, self.source(name).prior_weight = (list(estimate.fit),
                                                                     estimate.prior_weight)
        if self.plain_seconds:
            self.plain_trial = 0

    # --- the model ---
    def source(self, name: str) -> SourceEstimate:
        if name not in self.sources:
            free = name in FREE_SOURCES
            k_max = self.max_lookup_tokens if free else self.block_tokens.get(name, self.k_max)
            a = self.prior.acceptance.get(name) if self.prior is not None and not free else None
            # (a host search's acceptance is the text's, not the calibration prompts')
            self.sources[name] = SourceEstimate(k_max, self.acceptance_prior if a is None else a,
                                                self.decay, free, name in self.block_tokens)
        return self.sources[name]

    @property
    def plain_seconds(self) -> Optional[float]:
        """t_plain: the median steady lap, else the mean timed step, else the calibration's."""
        if self.steady_laps:
            return statistics.median(self.steady_laps)
        n, seconds = self.plain_time
        if n:
            return seconds / n
        return self.prior.plain_seconds if self.prior is not None else None

    measured_plain_seconds = plain_seconds

    def _prior_line(self, name: str, estimate: SourceEstimate) -> Optional[tuple]:
        """The prior's T_s(k) = base + slope k: a calibration's rounds (the line through k = 1
        and the cap), else t_plain + k v + D_s(k); None while t_plain is unknown."""
        if self.prior is not None and self.prior.knows(name):
            one, top = (self.prior.round_seconds(name, k) for k in (1, estimate.k_max))
            slope = (top - one) / (estimate.k_max - 1) if estimate.k_max > 1 else 0.0
            return one - slope, slope
        plain = self.plain_seconds
        if not plain:
            return None
        v = self.verify_seconds()
        step = 0.0 if estimate.free else self.step_seconds.get(name, UNKNOWN_STEP_SHARE * plain)
        return (plain + step, v) if estimate.block else (plain, v + step)

    def _node_seconds(self, estimate: Optional[SourceEstimate] = None) -> float:
        """v: what one more verified token costs (a tree's nodes beyond its depth): the
        source's tree rounds' (`estimate`), shrunk to the calibration's verify curve, else
        to `verify_seconds` (the host searches' timed rounds and the prefill's per token)."""
        if estimate is not None:
            return estimate.node_seconds(self._node_seconds())
        if self.prior is not None and len(self.prior.verify_seconds) > 1:
            points = sorted(self.prior.verify_seconds.items())
            (n0, t0), (n1, t1) = points[0], points[-1]
            return max((t1 - t0) / (n1 - n0), 0.0)
        return self.verify_seconds()

    def verify_seconds(self) -> float:
        """v with no calibration: what one more verified token costs. The host searches' timed
        rounds' (each round's seconds less t_plain, per draft: `_time_verify`), shrunk to
        the prefill's per-token time by VERIFY_PRIOR_ROUNDS. The prefill runs no output layer
        over its positions and amortises its weights over many rows, so on a CPU it reads low
        (a quantized SmolLM2 with netlib: 0.06 s a token, where a verified token costs 0.09 s
        and a plain step 0.095 s); at most t_plain."""
        plain = self.plain_seconds or 0.0
        prior = self.verify_per_token or UNKNOWN_VERIFY_SHARE * plain
        rounds, total = self.verify_rounds
        return min((VERIFY_PRIOR_ROUNDS * prior + total) / (VERIFY_PRIOR_ROUNDS + rounds), plain)

    def _time_verify(self, seconds: float, k: int) -> None:
        """A host search's timed chain round of `k` drafts tells v: its seconds less a plain
        step's, per draft (at most t_plain: a stall). A paid source's rounds do not: costs its
        one timed step misses would read as the target's, and its own line has them."""
        plain = self.plain_seconds
        if not plain:
            return
        v = min(max(seconds - plain, 0.0) / k, plain)
        self.verify_rounds = [self.decay * self.verify_rounds[0] + 1.0,
                              self.decay * self.verify_rounds[1] + v]

    def best(self, name: str, acceptance: Optional[float] = None):
        """(k*, rate_s(k*) t_plain): the best length and its speed over plain decoding's."""
        return self.best_shape(name, acceptance)[:2]

    def best_shape(self, name: str, acceptance: Optional[float] = None):
        """(k*, rate t_plain, w*): the best length and tree width, and their speed over plain
        decoding's."""
        if (name, acceptance) not in self._best:
            self._best[name, acceptance] = self._argmax(name, acceptance)
        return self._best[name, acceptance]

    def _argmax(self, name: str, acceptance: Optional[float], widths=None,
                optimistic: bool = False):
        """rate_s(k, w) for every k and w in one pass a width: the line and E_s(k, w) built up
        once, not per k. With `acceptance` every draft is kept with that chance (chains)."""
        plain, estimate = self.plain_seconds, self.source(name)
        line = estimate.line(self._prior_line(name, estimate))
        if not plain or line is None:
            return 0, None, 1
        if widths is None:
            widths = range(1, (estimate.max_width if acceptance is None else 1) + 1)
        best_k, best_rate, best_w = 0, -1.0, 1
        v = self._node_seconds(estimate) if estimate.max_width > 1 else 0.0
        lengths = range(1, estimate.k_max + 1)
        seconds = [at(line, k) for k in lengths]  # T_s(k), k = 1..k_max
        chances = [estimate.chance_at(k) for k in lengths] if acceptance is None else None
        for w in widths:
            rescued = estimate.sibling_chance(w, optimistic)  # b_s,w
            tokens, survive = 1.0, 1.0
            for k in lengths:
                if chances is not None:
                    a = chances[k - 1]
                    tokens += survive * (a + (1.0 - a) * rescued)
                    survive *= a
                else:
                    tokens = expected_tokens_per_round(acceptance, k)
                rate = tokens / (seconds[k - 1] + (w - 1) * k * v)
                if rate > best_rate:
                    best_k, best_rate, best_w = k, rate, w
        return best_k, best_rate * plain, best_w

    # --- the policy protocol ---
    def proposal_length(self, name: str) -> int:
        estimate = self.source(name)
        if self.plain_trial > 0 or estimate.off_left > 0:
            return 0
        if any(self.source(other).off_left == 0 for other in self.fallbacks.get(name, ())):
            self._aside.add(name)  # a fallback: its sources are on (or due a probe)
            return 0
        self._aside.discard(name)
        k, ratio = self.best(name)
        if ratio is None:
            return 0
        if self.auto_off:
            if self.hopeless(name):  # no probe can change that
                estimate.off_left, estimate.probing = MAX_OFF_STEPS, 0
                if not estimate.switched_off:
                    estimate.switched_off = 1
                return 0
            exploring = estimate.rounds == 0 or estimate.probing == PROBE_ROUNDS
            if exploring and not self._worth_exploring(name, k):
                estimate.off_left = MAX_OFF_STEPS  # it costs more than it could win
                estimate.switched_off = max(estimate.switched_off, 1)
                return 0
            if estimate.probing == PROBE_ROUNDS and self._probe_over_budget(name, k):
                estimate.off_left = PLAIN_BLOCK  # not yet
                return 0
            if ratio < 1.0 - OFF_MARGIN and estimate.rounds and not estimate.probing:
                estimate.switch_off()
                return 0
        estimate.width = self.best_shape(name)[2]
        if estimate.rounds == 0 and self.initial and not estimate.free:
            k = min(self.initial, estimate.k_max)
        elif estimate.rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            step = max(1, k // 4)
            k = k + step if (estimate.rounds // EXPLORE_EVERY) % 2 == 0 else k - step
        elif estimate.rounds >= estimate.widen_at and self._wider_may_pay(name, ratio):
            estimate.width += 1  # a trial: its rounds measure b_s,w
            estimate.widening = True
        estimate.k = min(max(k, 1), estimate.k_max)
        return estimate.k

    def _wider_may_pay(self, name: str, ratio: float) -> bool:
        """Whether a tree one wider than the chosen shape could beat it and plain decoding,
        its siblings kept with the hopeful chance (SIBLING_HOPE: a trial then measures it)."""
        estimate = self.source(name)
        wider = estimate.width + 1
        if wider > estimate.max_width:
            return False
        hopeful = self._argmax(name, None, widths=[wider], optimistic=True)[1]
        return hopeful is not None and hopeful > max(ratio, 1.0)

    def fall_back(self, name: str, behind: Sequence[str]) -> None:
        """Ask source `name` only in rounds where every one of `behind` sits out (an off period,
        a probe waiting): prompt lookup behind a paid drafter at T > 0, where asked first its
        point mass would take rounds from the drafter's closer q while the drafter wins, but
        in the drafter's off periods it is lookup alone, with its own verdict and off switch."""
        self._best.clear()
        self.fallbacks[name] = tuple(behind)

    def allow_trees(self, name: str, max_width: int) -> None:
        """Source `name` may propose token trees up to `max_width` wide (drafters/tree.py)."""
        self._best.clear()
        self.source(name).max_width = max(1, max_width)

    def tree_width(self, name: str) -> int:
        """The tree width for the round `proposal_length(name)` just chose (1: a chain)."""
        return self.source(name).width

    def hopeless(self, name: str) -> bool:
        """Whether the source would lose even with every draft kept (False while unknown)."""
        ratio = self.best(name, acceptance=1.0)[1]
        return ratio is not None and ratio < 1.0 - OFF_MARGIN

    def _worth_exploring(self, name: str, k: int) -> bool:
        """Whether a source's first round, or a probe, may pay for itself: what it would save over
        the next PROBE_HORIZON tokens (at most the reply's tokens left: `horizon`) if it
        turned out to keep drafts as often as the better of its estimate and its prior, against
        the round's predicted loss plus its catch-up (a draft model fed every token it missed,
        its prompt too if it was never prefilled)."""
        estimate, plain = self.source(name), self.plain_seconds
        if estimate.free:  # its rounds cost verify passes only: known once one was timed; a
            # request's first round is its verdict, whatever earlier requests measured
            measured = estimate.rounds > 0 and self.verify_rounds[0] > 0
        else:
            measured = self.prior is not None and self.prior.knows(name) or (
                self.verify_per_token is not None and name in self.step_seconds)
        if not measured:  # its costs are guesses: only a round can tell
            return True
        hopeful = max(estimate.acceptance, estimate.prior)  # its prior: the calibration's,
        # the prompt look's (a look that found the source weak is no reason to try it) or the guess
        ratio = self.best(name, acceptance=hopeful)[1] or 0.0
        seconds = (estimate.seconds(k, self._prior_line(name, estimate)) or 0.0) \
            + self._catch_up(name, estimate)
        loss = max(seconds - estimate.expected_tokens(k) * plain, 0.0)
        return (ratio - 1.0) * self.horizon() * plain > loss

    def horizon(self) -> int:
        """Tokens a verdict decides about: PROBE_HORIZON, or the reply's tokens left if fewer
        (what a first round or probe finds out pays only in the reply that follows it)."""
        return PROBE_HORIZON if self.reply_left is None else min(PROBE_HORIZON, self.reply_left)

    def expect_reply(self, tokens: int) -> None:
        """The loop: the reply may take `tokens` tokens (its max_tokens); each round observed
        counts against them."""
        self.reply_left = tokens

    def _catch_up(self, name: str, estimate: SourceEstimate) -> float:
        """Predicted seconds to feed a paid source what it missed: per token its prefill's
        (measured, else its step times the target's prefill-to-step ratio)."""
        if estimate.free:
            return 0.0
        per_token = self.catch_up_seconds.get(name)
        backlog = estimate.since
        if per_token is None:  # never prefilled: the prompt waits too
            plain, step = self.plain_seconds, self.step_seconds.get(name)
            if not (step and plain and self.verify_per_token):
                return 0.0
            per_token = step * min(self.verify_per_token / plain, 1.0)
            backlog += self.prompt_tokens
        return per_token * backlog

    def _probe_over_budget(self, name: str, k: int) -> bool:
        """Whether a due probe must wait: a source probed before, whose probe's predicted loss
        (its catch-up included) would take the probes' net loss past PROBE_BUDGET of the time
        decoded. (Rounds the model chose are not exploration: their losses are its errors.)"""
        estimate = self.source(name)
        if not estimate.rounds or estimate.switched_off < 2:
            return False
        plain = self.plain_seconds
        seconds = (estimate.seconds(k, self._prior_line(name, estimate)) or 0.0) \
            + self._catch_up(name, estimate)
        loss = seconds - estimate.expected_tokens(k) * plain
        return self.lost + max(loss, 0.0) > PROBE_BUDGET * self.elapsed

    def num_draft_tokens(self) -> int:
        return self.proposal_length("draft")

    def plain_steps(self) -> int:
        if self.plain_trial:
            return self.plain_trial
        aside, self._aside = self._aside, set()
        if any(self.sources[name].off_left == 0 and all(self.source(other).off_left > 0
                                                        for other in self.fallbacks[name])
               for name in aside):
            return 1  # it stood aside this round, and its sources just went off: ask it next
        return min((s.off_left for s in self.sources.values() if s.off_left > 0),
                   default=PLAIN_BLOCK)

    def observe(self, round_, seconds: Optional[float]) -> None:
        drafter = self.sources.get(round_.source) if round_.num_drafted else None
        if drafter is not None and not drafter.free:  # a paid source's round changes its own
            for key in [key for key in self._best if key[0] == round_.source]:  # estimate
                del self._best[key]  # alone: t_plain, v and the other sources' stand
        else:
            self._best.clear()
        tokens = len(round_.tokens)
        if self.reply_left is not None:
            self.reply_left = max(self.reply_left - tokens, 0)
        for name, estimate in self.sources.items():
            if name != round_.source:
                estimate.passed(tokens)
        if seconds is not None:
            self.elapsed += seconds
        if round_.num_drafted == 0:
            self._time_plain_step(seconds, getattr(round_, "opens_block", False))
            self.plain_trial = max(self.plain_trial - 1, 0)
            return
        self._block = []  # a round ends any plain block
        name, estimate = round_.source, self.source(round_.source)
        k = round_.num_drafted  # a tree's depth: its nodes beyond it are priced at v
        nodes = getattr(round_, "tree_nodes", 0)
        if seconds is not None and self.plain_seconds and estimate.probing:
            self.lost += seconds - tokens * self.plain_seconds
        estimate.forget(k)
        if seconds is not None and not estimate.free and estimate.since:
            catch_up = self.catch_up_seconds.get(name)
            if catch_up is not None:
                seconds = max(seconds - catch_up * estimate.since, 1e-9)
            elif estimate.since >= CATCH_UP_TOKENS:
                seconds = None  # a catch-up of unknown cost: not its length's time
        spine = getattr(round_, "spine_kept", None)  # a tree round: the spine's drafts kept
        drafted = round_.num_drafted if spine is None else (  # ... of its own drafts
            getattr(round_, "spine_length", None) or round_.num_drafted)
        estimate.count_chain(drafted, round_.num_accepted if spine is None else spine,
                             getattr(round_, "chances", None) if spine is None else None)
        tried = spine is not None and spine < drafted  # siblings were looked at
        rescued = tried and round_.num_accepted > spine
        if tried and estimate.max_width > 1:
            estimate.count_siblings(round_.tree_width, rescued)
        if estimate.widening:  # a trial that kept a sibling says try again soon; one that
            estimate.widening = False  # looked at siblings and kept none, later
            if rescued:
                estimate.widen_every = EXPLORE_EVERY
            elif tried:
                estimate.widen_every = min(2 * estimate.widen_every, MAX_OFF_STEPS)
            estimate.widen_at = estimate.rounds + 1 + estimate.widen_every
        if seconds is not None and nodes > k:  # a tree: its nodes beyond its depth cost v_s
            line = self._prior_line(name, estimate)
            at_depth = estimate.seconds(k, line) or 0.0
            estimate.count_nodes(nodes - k, seconds, at_depth)
            seconds = max(seconds - (nodes - k) * self._node_seconds(estimate), 1e-9)
        if seconds is not None:
            if not nodes and estimate.free and self.prior is None:
                self._time_verify(seconds, k)
            estimate.add(k, seconds)
        estimate.rounds += 1
        estimate.since = 0
        if estimate.probing:
            estimate.probing -= 1
            if not estimate.probing and (self.best(name)[1] or 0.0) >= 1.0 - OFF_MARGIN:
                estimate.off_steps = FIRST_OFF_STEPS  # it wins again: a loss is news again

    def _time_plain_step(self, seconds: Optional[float], opens_block: bool) -> None:
        """Add a plain step's lap to its block; the lap before it, with one before it too, is
        a steady step (a block's first lap carries the queue's fill, its last is short)."""
        if opens_block:
            self._block = []
        if seconds is not None:
            self.plain_time = [self.plain_time[0] + 1, self.plain_time[1] + seconds]
        self._block.append(seconds)
        if len(self._block) >= 3 and self._block[-2] is not None:
            self.steady_laps.append(self._block[-2])

    # --- what the loop measures before the first round ---
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target prefilled `tokens` in `seconds`: the prior of v, what one more verified
        token costs (`verify_seconds`; a short prompt's time is mostly fixed cost, and tells
        nothing), and of a never-prefilled draft's catch-up."""
        self._best.clear()
        self.prompt_tokens = tokens
        if tokens >= CATCH_UP_TOKENS and seconds > 0:
            self.verify_per_token = seconds / tokens

    def wants_draft_step(self, source: str) -> bool:
        """Whether the loop should time one step of a paid `source` after its prefill."""
        return self.prior is None and source not in FREE_SOURCES

    def observe_draft_step(self, source: str, seconds: Optional[float]) -> None:
        self._best.clear()
        if seconds:
            self.step_seconds[source] = seconds

    def observe_catch_up(self, source: str, tokens: int, seconds: float) -> None:
        """A paid source was fed `tokens` (the history so far) in `seconds`: a catch-up's cost
        per token; it has seen every token decoded so far."""
        self._best.clear()
        self.source(source).since = 0
        if tokens >= CATCH_UP_TOKENS and seconds > 0:
            self.catch_up_seconds[source] = seconds / tokens

    def wants_prompt_look(self, greedy: bool = False) -> bool:
        """Whether the loop should measure the paid sources' acceptance on the prompt's last
        positions (mlx_spec/prompt_look.py): at T > 0 with no calibration. Greedy, the prompt
        is no guide (a target's own greedy continuation is easier to guess)."""
        return self.auto_off and self.prior is None and not greedy

    def observe_prompt_look(self, source: str, acceptance: float, rows: int,
                            greedy: bool = False) -> None:
        """The look's acceptance replaces the guessed prior, weighing as much, also when it comes
        after the source's first round (a request whose policy learnt the machine from the one
        before it drafts at once: no plain trial) (`SourceEstimate.reprior`)."""
        self._best.clear()
        estimate = self.source(source)
        if not self.wants_prompt_look(greedy) or rows < 1:
            return
        estimate.reprior(min(max(acceptance, 0.0), 1.0))
        estimate.looked = True

    def still_looks(self, source: str) -> bool:
        """Whether a prompt look at `source` can still change anything: its prior still weighs
        (at most one round drafted: the look comes after a request's first round) and it is
        neither off nor hopeless."""
        estimate = self.sources.get(source)
        return estimate is None or (estimate.rounds <= 1 and estimate.off_left == 0
                                    and not self.hopeless(source))

    def look_rows(self, seconds_per_token: Optional[float], tokens: int, most: int) -> int:
        """How many of the `most` rows the prompt look may compare: as many as LOOK_SHARE of
        `tokens` plain steps buys, the look costing LOOK_FIXED_TOKENS plus LOOK_ROW_TOKENS a
        row of prompt tokens' prefill (`most` while either time is unknown)."""
        step = self.plain_seconds
        if not (seconds_per_token and step):
            return most
        budget = LOOK_SHARE * tokens * step / seconds_per_token  # in prompt tokens
        return max(0, min(most, int((budget - LOOK_FIXED_TOKENS) / LOOK_ROW_TOKENS + 1e-9)))

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

    def describe(self) -> dict:
        return {
            "policy": "adaptive", "calibrated": self.prior is not None,
            "k": {name: s.k for name, s in self.sources.items()},
            "acceptance_estimate": {name: round(s.acceptance, 3)
                                    for name, s in self.sources.items()},
            "switched_off": self.switched_off,
            "plain_seconds": self.plain_seconds,
        }


class MachineRecord:
    """What a server's requests measured of the machine, handed on from each request's
    adaptive policy to the next one's (`AdaptivePolicy.learn_machine`): a call given one
    (speculative_generate_step's `machine`) starts from the last policy it holds and leaves
    its own there."""

    def __init__(self):
        self.policy: Optional[AdaptivePolicy] = None

    def hand_on(self, policy) -> None:
        """`policy` (a new call's) learns from the last one, and is the last one now."""
        if not isinstance(policy, AdaptivePolicy):
            return  # a fixed k measures nothing for the next
        if self.policy is not None:
            policy.learn_machine(self.policy)
        self.policy = policy


def make_policy(num_draft_tokens=None, adaptive=None, max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS,
                auto_off=True, prior: Optional[CostPrior] = None,
                max_lookup_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS,
                acceptance_prior: float = DEFAULT_ACCEPTANCE_PRIOR,
                block_tokens: Optional[Dict[str, int]] = None):
    """A pinned k gives FixedPolicy; otherwise the default policy. The arguments were checked
    where they entered (`check_arguments`); the policies check only what they are built with."""
    if adaptive is None:
        adaptive = num_draft_tokens is None  # a pinned k is a fixed policy
    if adaptive:
        return AdaptivePolicy(max_draft_tokens, num_draft_tokens, auto_off=auto_off,
                              max_lookup_tokens=max_lookup_tokens, prior=prior,
                              block_tokens=block_tokens, acceptance_prior=acceptance_prior)
    return FixedPolicy(num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
