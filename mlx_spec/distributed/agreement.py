"""Every rank takes rank 0's decisions, inside each round's graph: no extra host sync.

A sharded target runs the same loop on every rank: each rank drafts with its
own replicated draft, runs its share of the verify pass, and applies the
acceptance rule. For the ranks to stay in step they must feed the target the
same tokens and keep the same ones. `RankAgreement` makes that hold by
construction rather than by hoping that floating point agrees everywhere:

- `broadcast(x)`: rank 0's values of `x` on every rank, as an all-sum to which
  the other ranks add zeros (`x * 0`, so that their own graph, the target's
  collectives included, is still evaluated). Model drafts go through it
  before the verify pass, so every shard verifies rank 0's drafts.
- `decide(x)`: the same for the round's summary (accepted count, next token,
  drafts) or a plain step's token, with rank 0's timing of the last observed
  round riding along in the same all-sum. The loop's one host sync of the
  round reads it on every rank.
- `AgreedPolicy` hands a policy rank 0's round times (one round late, when
  they arrive) in place of the times this rank measured, so an adaptive policy updates
  from identical numbers on every rank and chooses identical k.

On identical Macs the replicated drafts and the rule's draws are equal anyway
(the same weights, the same seed); the broadcast keeps the ranks together on
Macs that round differently, at the cost of two small all-sums per round.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Deque, Dict, List, Optional

import mlx.core as mx

MAX_MICROSECONDS = 2**31 - 1  # an int32 of microseconds: a round of up to 35 minutes
TIME_WINDOW = 4  # round times each decision carries: up to 2 rounds are observed between two


class RankAgreement:
    """Rank 0's values for every rank of `group`, folded into the round's own graph."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self._marks = 0  # rounds this rank has observed
        self._times = [0] * TIME_WINDOW  # microseconds of the last rounds, as this rank measured
        self._decided: Deque[mx.array] = deque()  # full all-sum results, oldest first

    def _from_rank0(self, x: mx.array) -> mx.array:
        mask = 1 if self.rank == 0 else 0  # x * 0 keeps this rank's graph (its collectives) in
        return mx.distributed.all_sum(x * mask, group=self.group)

    def broadcast(self, x: mx.array) -> mx.array:
        """Rank 0's `x` (integers below 2^31) on every rank, lazily."""
        flat = x.reshape(-1).astype(mx.int32)
        return self._from_rank0(flat).astype(x.dtype).reshape(x.shape)

    def decide(self, x: mx.array) -> mx.array:
        """`broadcast(x)`, carrying rank 0's times for the last TIME_WINDOW rounds it observed."""
        flat = x.reshape(-1).astype(mx.int32)
        payload = mx.array([self._marks] + self._times, mx.int32)
        full = self._from_rank0(mx.concatenate([flat, payload]))  # (x.size + 1 + TIME_WINDOW,)
        self._decided.append(full)
        return full[: flat.size].astype(x.dtype).reshape(x.shape)

    def mark(self, seconds: Optional[float]) -> None:
        """A round was observed, taking `seconds` on this rank (rank 0's is the one sent)."""
        self._marks += 1
        seconds = seconds or 0.0
        self._times = self._times[1:] + [min(int(seconds * 1e6), MAX_MICROSECONDS)]

    def received(self) -> Dict[int, float]:
        """{round index: seconds} rank 0 sent with the oldest decision synced (its last rounds).

        Called once per observed round: the decisions are synced in the order
        they were built, so the oldest one is the round just observed. Reading
        it costs no device work (the round's sync evaluated it).
        """
        if not self._decided:
            return {}
        last, *microseconds = self._decided.popleft().tolist()[-1 - TIME_WINDOW:]
        first = last - TIME_WINDOW + 1
        return {first + i: us / 1e6 for i, us in enumerate(microseconds) if first + i > 0}


class AgreedDrafter:
    """A drafter whose model drafts every rank replaces by rank 0's (lookup needs no help).

    Prompt lookup proposes from the shared history, a host computation that is
    the same on every rank; a model's drafts come from floating point, so they
    are broadcast into the verify pass.
    """

    def __init__(self, drafter, agreement: RankAgreement):
        self.drafter = drafter
        self.agreement = agreement

    def propose(self, history: List[int], k: int):
        proposal = self.drafter.propose(history, k)
        if proposal is None or proposal.source == "lookup":
            return proposal
        tokens = self.agreement.broadcast(proposal.tokens)
        # Queued now, so every rank runs this all-sum before the verify pass's collectives:
        # a pipeline stage's recv does not depend on its input, and could otherwise be
        # scheduled first on rank 0 while rank 1 waits in this all-sum.
        mx.async_eval(tokens)
        return replace(proposal, tokens=tokens)

    def __getattr__(self, name):
        return getattr(self.drafter, name)


class AgreedPolicy:
    """A policy told rank 0's round times, on every rank, in the same order.

    Each observed round is held until rank 0's time for it arrives (in a later
    round's decision), then passed on with exactly that time. The policy therefore sees the same rounds with the same times on
    every rank, one or two rounds late, and chooses the same lengths. A round
    whose time can no longer arrive (more than TIME_WINDOW rounds between two
    decisions, which the loop never does) is left out, on every rank alike.
    """

    def __init__(self, policy, agreement: RankAgreement):
        self.policy = policy
        self.agreement = agreement
        self._held: Deque = deque()
        self._times: Dict[int, float] = {}
        self._latest = 0  # the newest round index rank 0 has sent a time for
        self._told = 0  # rounds passed on to the policy (or left out)

    def proposal_length(self, source: str) -> int:
        return self.policy.proposal_length(source)

    def plain_steps(self) -> int:
        return self.policy.plain_steps()

    def observe(self, round_, seconds: Optional[float]) -> None:
        sent = self.agreement.received()
        self._times.update({i: t for i, t in sent.items() if i > self._told})
        self._latest = max([self._latest, *sent])
        self.agreement.mark(seconds)
        self._held.append(round_)
        while self._held:
            index = self._told + 1
            if index in self._times:
                self.policy.observe(self._held.popleft(), self._times.pop(index))
            elif index <= self._latest - TIME_WINDOW:  # its time was never sent
                self._held.popleft()
            else:
                break
            self._told = index

    def observe_catch_up(self, source: str, tokens: int, seconds: float) -> None:
        if hasattr(self.policy, "observe_catch_up"):
            self.policy.observe_catch_up(source, tokens, self._rank0(seconds))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if hasattr(self.policy, "observe_prefill"):
            self.policy.observe_prefill(tokens, self._rank0(seconds))

    def observe_draft_step(self, source: str, seconds: float) -> None:
        self.policy.observe_draft_step(source, self._rank0(seconds))

    def _rank0(self, seconds: float) -> float:
        """Rank 0's `seconds` on every rank: a time measured before the rounds (a draft's
        prefill, one timed draft step) must not set the ranks' policies apart. One small
        all-sum, read at once (prefill only)."""
        microseconds = mx.array([min(int(seconds * 1e6), MAX_MICROSECONDS)], mx.int32)
        return self.agreement.broadcast(microseconds).item() / 1e6

    def describe(self) -> dict:
        return self.policy.describe()

    def __getattr__(self, name):
        return getattr(self.policy, name)


def agree_across_ranks(target_model, drafters, policy, draft_confidence: float = 0.0):
    """(drafters, policy, agree) for the loop: wrapped for a sharded target, as given otherwise.

    Also reseeds every rank's random stream from a draw of rank 0's (the one
    sync this adds, once per call, before prefill), so that the replicated
    drafts at temperature > 0 are rank 0's too and every draft cache follows
    the text. A seeded run stays reproducible; it just draws other numbers
    than one process would.
    """
    from .group import sharding_group

    group = sharding_group(target_model)
    if group is None:
        return drafters, policy, None
    if draft_confidence:
        raise ValueError("draft_confidence stops drafting on each rank's own host values, so "
                         "sharded ranks could verify different lengths; leave it at 0 with a "
                         "sharded target.")
    agreement = RankAgreement(group)
    seed = agreement.broadcast(mx.random.randint(0, 2**31 - 1, (1,)))
    mx.random.seed(seed.item())  # once per call, not per round
    return ([AgreedDrafter(d, agreement) for d in drafters], AgreedPolicy(policy, agreement),
            agreement.decide)
