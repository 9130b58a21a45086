"""Generation statistics: acceptance histogram, rates, tokens/s, memory.

Following gpt-fast, the main metric is the histogram of accepted lengths per
round; acceptance rate, mean accepted length and per-position acceptance all
fall out of it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import mlx.core as mx


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    rounds: int = 0  # verify passes that had drafts
    plain_steps: int = 0  # ordinary decoding steps (no draft)
    drafted: int = 0
    accepted: int = 0
    accepted_histogram: Tuple[int, ...] = ()  # [n] = rounds that accepted n drafts
    drafted_at_position: Tuple[int, ...] = ()  # [i] = rounds that drafted >= i+1 tokens
    accepted_by_source: Dict[str, int] = field(default_factory=dict)
    draft_lengths: Tuple[int, ...] = ()  # k of every speculative round, in order
    peak_memory_gb: float = 0.0
    calibrated: Optional[bool] = None  # adaptive policy started from a calibration (None: fixed k)
    rule: str = "greedy"  # the acceptance rule: "greedy", "residual" or "sampler match"
    # A draft of another tokenizer: the fraction of the target's tokens with a twin (same
    # string) in the draft's vocabulary, and per crossing rule ("string", "intersection")
    # (rounds, drafted, accepted)
    vocab_overlap: Optional[float] = None
    cross_rules: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)
    tree_rounds: int = 0  # rounds that verified a token tree (their drafted count: its depth)
    tree_nodes: int = 0  # tree nodes verified in those rounds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per speculative round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per target pass over a draft (accepted + 1)."""
        return self.mean_accepted + 1 if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> List[float]:
        """P(draft i accepted | drafted), from the histogram."""
        rates = []
        for i, drafted in enumerate(self.drafted_at_position):
            accepted = sum(self.accepted_histogram[i + 1:])
            rates.append(accepted / drafted if drafted else 0.0)
        return rates

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted=self.mean_accepted,
            tokens_per_round=self.tokens_per_round,
            per_position_acceptance=self.per_position_acceptance,
        )
        for key in ("accepted_histogram", "drafted_at_position", "draft_lengths"):
            d[key] = list(d[key])
        return d

    def summary(self) -> str:
        lines = [
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s",
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tokens/s",
        ]
        if self.rounds:
            hist = " ".join(f"{n}:{c}" for n, c in enumerate(self.accepted_histogram))
            pos = " ".join(f"{r:.2f}" for r in self.per_position_acceptance)
            lines += [
                f"Speculation: {self.rounds} rounds, {self.accepted}/{self.drafted} drafts "
                f"accepted ({self.acceptance_rate:.1%}), {self.tokens_per_round:.2f} tokens/round",
                f"Accepted-length histogram: {hist}",
                f"Per-position acceptance: {pos}",
            ]
            if len(set(self.draft_lengths)) > 1:
                ks = self.draft_lengths
                lines.append(f"Draft length k: mean {sum(ks) / len(ks):.1f}, range {min(ks)}-{max(ks)}, "
                             f"last {ks[-1]}")
            if len(self.accepted_by_source) > 1 or \
                    {"lookup", "suffix"} & set(self.accepted_by_source):
                src = ", ".join(f"{s} {n}" for s, n in sorted(self.accepted_by_source.items()))
                lines.append(f"Accepted tokens by source: {src}")
        if self.vocab_overlap is not None:
            rules = "; ".join(f"{name} {r} rounds, {a}/{d} accepted"
                              for name, (r, d, a) in sorted(self.cross_rules.items()))
            lines.append(f"Draft of another tokenizer ({self.vocab_overlap:.1%} of the target's "
                         f"tokens have a twin): {rules or 'no rounds'}")
        if self.tree_rounds:
            lines.append(f"Token trees: {self.tree_rounds} rounds, {self.tree_nodes} nodes "
                         f"verified ({self.tree_nodes / self.tree_rounds:.1f} a round)")
        if self.plain_steps and (self.rounds or self.drafted):
            lines.append(f"Plain decoding steps (no draft): {self.plain_steps}")
        if self.rule == "sampler match" and self.rounds:
            lines.append("Acceptance: a draft is kept while it equals the sampler's own draw "
                         "(a sampler mlx-spec cannot read)")
        if self.calibrated is not None and (self.rounds or self.calibrated):
            lines.append("Calibration: " + ("this machine's, from `mlx-spec tune`" if self.calibrated
                                            else "none (run `mlx-spec tune` to start warm)"))
        lines.append(f"Peak memory: {self.peak_memory_gb:.3f} GB")
        return "\n".join(lines)


class StatsRecorder:
    """Accumulates rounds; `snapshot()` returns the frozen stats so far."""

    def __init__(self, prompt_tokens: int, calibrated: Optional[bool] = None, rule: str = "greedy",
                 vocab_overlap: Optional[float] = None):
        self.prompt_tokens = prompt_tokens
        self.calibrated = calibrated
        self.rule = rule
        self.vocab_overlap = vocab_overlap
        self.cross_rules: Dict[str, List[int]] = {}
        self.start = time.perf_counter()
        self.prompt_seconds = None
        self.generation_tokens = 0
        self.rounds = self.plain_steps = self.drafted = self.accepted = 0
        self.histogram: Counter = Counter()
        self.drafted_at: Counter = Counter()
        self.by_source: Counter = Counter()
        self.draft_lengths: List[int] = []
        self.tree_rounds = self.tree_nodes = 0

    def prompt_done(self) -> None:
        if self.prompt_seconds is None:
            now = time.perf_counter()
            self.prompt_seconds = now - self.start
            self.start = now

    def handed(self) -> None:
        """Count a token handed to the caller (an EOS too, as mlx-lm counts it)."""
        self.generation_tokens += 1

    def record(self, round_) -> None:
        """Count a round (its tokens are counted as they are handed out)."""
        if round_.num_drafted == 0:
            self.plain_steps += 1
            return
        self.rounds += 1
        self.drafted += round_.num_drafted
        self.accepted += round_.num_accepted
        self.histogram[round_.num_accepted] += 1
        for i in range(round_.num_drafted):
            self.drafted_at[i] += 1
        self.by_source[round_.source] += round_.num_accepted
        self.draft_lengths.append(round_.num_drafted)
        nodes = getattr(round_, "tree_nodes", 0)  # (a batch row's output has none)
        if nodes:
            self.tree_rounds += 1
            self.tree_nodes += nodes
        cross_rule = getattr(round_, "cross_rule", None)  # (a batch row's output has none)
        if cross_rule is not None:
            counts = self.cross_rules.setdefault(cross_rule, [0, 0, 0])
            for i, n in enumerate((1, round_.num_drafted, round_.num_accepted)):
                counts[i] += n

    def snapshot(self) -> GenerationStats:
        elapsed = time.perf_counter() - self.start
        longest = max(self.drafted_at, default=-1) + 1
        prompt_seconds = self.prompt_seconds or 0.0
        return GenerationStats(
            prompt_tokens=self.prompt_tokens,
            prompt_tps=self.prompt_tokens / prompt_seconds if prompt_seconds else 0.0,
            generation_tokens=self.generation_tokens,
            generation_tps=self.generation_tokens / elapsed if elapsed > 0 else 0.0,
            rounds=self.rounds,
            plain_steps=self.plain_steps,
            drafted=self.drafted,
            accepted=self.accepted,
            accepted_histogram=tuple(self.histogram[n] for n in range(longest + 1)),
            drafted_at_position=tuple(self.drafted_at[i] for i in range(longest)),
            accepted_by_source=dict(self.by_source),
            draft_lengths=tuple(self.draft_lengths),
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            calibrated=self.calibrated,
            rule=self.rule,
            vocab_overlap=self.vocab_overlap,
            cross_rules={name: tuple(c) for name, c in self.cross_rules.items()},
            tree_rounds=self.tree_rounds,
            tree_nodes=self.tree_nodes,
        )
