"""How many tokens to draft each round, and when not to speculate at all.

A policy answers `num_draft_tokens()` before each round (0 = decode plainly
for `plain_steps()` steps) and is told every finished round via `observe`.
Policies only choose k; exactness never depends on them, because any k that
does not peek at the target's randomness leaves the output distribution
untouched.
"""

from __future__ import annotations

import time
from typing import Protocol

from .costmodel import expected_tokens_per_round
from .defaults import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_NUM_DRAFT_TOKENS

DEFAULT_ADAPTIVE = True  # the bench: adaptive beat the best fixed k over the prompt set (README)
DEFAULT_DECAY = 0.9  # weight of the past in the online estimates, per round
FIRST_OFF_STEPS = 32  # plain steps after speculation is switched off; doubles each time
MAX_OFF_STEPS = 256
FIRST_ROUNDS = 3  # speculative rounds (k, k/2, 3k/2) before speculation is judged
PROBE_ROUNDS = 3  # speculative rounds tried after an off period before it is judged again
PLAIN_TRIAL_STEPS = 4  # plain steps timed before the first switch-off (the fit's t(0) is noisy)
OFF_MARGIN = 0.05  # switch off only when predicted >5% slower: estimates are noisy, ties cost little
EXPLORE_EVERY = 6  # every so often try k +/- 1 to keep the cost fit honest


class DraftPolicy(Protocol):
    def num_draft_tokens(self) -> int: ...
    def plain_steps(self) -> int: ...
    def observe(self, round_) -> None: ...
    def describe(self) -> dict: ...


class FixedPolicy:
    """Always draft k tokens (mlx-lm's behaviour)."""

    def __init__(self, num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}.")
        self.k = num_draft_tokens

    def num_draft_tokens(self) -> int:
        return self.k

    def plain_steps(self) -> int:
        return 1

    def observe(self, round_) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": "fixed", "k": self.k}


class AdaptivePolicy:
    """Pick k to maximise expected tokens per second; fall back to plain decoding when it loses.

    Online estimates, all exponentially decayed so they follow the text:
      - acceptance a: accepted / (accepted + rejections), the i.i.d. MLE;
      - seconds per round t(k) = t0 + t1 * k, least squares over the rounds seen;
      - seconds per plain step.
    Each round k* = argmax_k E[tokens | a, k] / t(k). A plain step costs
    t(0) until plain steps have been timed. When even k* is slower
    than plain decoding (by more than OFF_MARGIN), speculation is switched off
    for a block of plain steps (32, doubling while it keeps losing, up to 256),
    then probed again for PROBE_ROUNDS rounds, with the acceptance memory aged
    by the text decoded plainly, so a bad draft or a machine where verification
    is not cheap costs little and a hard opening does not keep a good draft off.
    """

    def __init__(self, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 initial_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
                 decay: float = DEFAULT_DECAY, auto_off: bool = True, clock=time.perf_counter):
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}.")
        self.k_max = max_draft_tokens
        self.k = self.k_initial = min(initial_draft_tokens, max_draft_tokens)
        self.decay = decay
        self.auto_off = auto_off
        self.clock = clock
        self.accepted, self.rejected = 3.0, 1.0  # prior: a = 0.75
        self.fit = [0.0] * 5  # decayed sums of 1, k, k^2, t, k*t
        self.plain_time = [0.0, 0.0]  # decayed sums of 1 and seconds over timed plain steps
        self.plain_left = 0
        self.off_steps = FIRST_OFF_STEPS
        self.probe_left = FIRST_ROUNDS - 1  # rounds to run before speculation is judged
        self.plain_run = 0  # plain steps since the last speculative round
        self.rounds = 0
        self.switched_off = 0
        self._last = None

    # --- estimates ---
    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def round_seconds(self, k: int):
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

    def tokens_per_second(self, k: int):
        seconds = self.round_seconds(k)
        if not seconds or seconds <= 0:
            return None
        return expected_tokens_per_round(self.acceptance, k) / seconds

    @property
    def measured_plain_seconds(self):
        n, seconds = self.plain_time
        return seconds / n if n > 0 else None

    @property
    def plain_seconds(self):
        """Seconds per plain step: measured once speculation was off, else the fit's t(0).

        A round with no drafts is one target pass over one token, which is a
        plain step, so the intercept of the round-time fit estimates it
        before any plain step has been timed.
        """
        estimate = self.measured_plain_seconds or self.round_seconds(0)
        return estimate if estimate and estimate > 0 else None

    def best_k(self) -> int:
        rates = {k: self.tokens_per_second(k) for k in range(1, self.k_max + 1)}
        if any(r is None for r in rates.values()):
            return self.k
        return max(rates, key=rates.get)

    # --- the policy protocol ---
    def num_draft_tokens(self) -> int:
        if self.plain_left > 0:
            return 0
        if self.rounds < 3:  # three different k first, so the cost fit has a slope
            k0 = self.k_initial
            return min([k0, max(1, k0 // 2), k0 + (k0 + 1) // 2][self.rounds], self.k_max)
        k = self.best_k()
        if self.rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            k = k + 1 if (self.rounds // EXPLORE_EVERY) % 2 == 0 else k - 1
        self.k = min(max(k, 1), self.k_max)
        return self.k

    def plain_steps(self) -> int:
        return max(self.plain_left, 1)

    def observe(self, round_) -> None:
        now = self.clock()
        seconds, self._last = (None if self._last is None else now - self._last), now
        if round_.num_drafted == 0:
            self.plain_left = max(self.plain_left - 1, 0)
            self.plain_run += 1
            if seconds is not None:
                self.plain_time = [self.decay * s + x for s, x in zip(self.plain_time, (1.0, seconds))]
            return
        self.rounds += 1
        self._forget_plain_run(round_.num_drafted)
        d = self.decay
        self.accepted = d * self.accepted + round_.num_accepted
        self.rejected = d * self.rejected + (round_.num_accepted < round_.num_drafted)
        if seconds is not None:
            k = round_.num_drafted
            self.fit = [d * s + x for s, x in zip(self.fit, (1.0, k, k * k, seconds, k * seconds))]
        self._maybe_switch_off()

    def _forget_plain_run(self, k: int) -> None:
        """Age the acceptance memory by the text decoded plainly since the last round.

        The memory decays per round; a plain run of n tokens is as much text as
        n / E[tokens per round] rounds, so it decays as if those had run. Without
        this, a hard opening (say a docstring the draft cannot guess) outvoted
        the probes that follow an off period, and speculation stayed off on text
        where it wins. The ratio accepted : rejected is kept and only its weight
        shrinks, so the probe rounds decide, and a useless draft is still judged useless.
        """
        if self.plain_run:
            rounds = self.plain_run / expected_tokens_per_round(self.acceptance, k)
            self.accepted *= self.decay ** rounds
            self.rejected *= self.decay ** rounds
            self.plain_run = 0

    def _maybe_switch_off(self) -> None:
        if not self.auto_off or not self.plain_seconds:
            return
        if self.probe_left > 0:
            self.probe_left -= 1
            return
        best = self.tokens_per_second(self.best_k())
        if best is None or best >= (1.0 - OFF_MARGIN) / self.plain_seconds:
            self.off_steps = FIRST_OFF_STEPS
        elif self.measured_plain_seconds is None:
            # The verdict rests on the fit's extrapolated t(0), which timing noise
            # easily halves: time a few real plain steps, then judge again.
            self.plain_left = PLAIN_TRIAL_STEPS
        else:
            self.plain_left = self.off_steps
            self.off_steps = min(2 * self.off_steps, MAX_OFF_STEPS)
            self.probe_left = PROBE_ROUNDS - 1
            self.switched_off += 1

    def describe(self) -> dict:
        return {
            "policy": "adaptive", "k": self.k, "acceptance_estimate": round(self.acceptance, 3),
            "switched_off": self.switched_off,
            "plain_seconds": self.plain_seconds,
        }



def make_policy(num_draft_tokens=None, adaptive=None, max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS,
                auto_off=True):
    """A pinned k gives FixedPolicy; otherwise the default policy."""
    if adaptive is None:
        adaptive = num_draft_tokens is None and DEFAULT_ADAPTIVE
    if num_draft_tokens is not None and num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}.")
    if adaptive:
        initial = num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
        return AdaptivePolicy(max_draft_tokens, initial, auto_off=auto_off)
    return FixedPolicy(num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
