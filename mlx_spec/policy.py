"""How many tokens to draft each round.

A policy answers `num_draft_tokens()` before each round (0 = decode plainly
for `plain_steps()` steps) and is told every finished round via `observe`.
"""

from __future__ import annotations

DEFAULT_NUM_DRAFT_TOKENS = 4


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


DraftPolicy = FixedPolicy
