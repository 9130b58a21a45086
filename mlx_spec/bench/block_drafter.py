"""The bench's block-drafter path: what a DFlash drafter costs and earns per round.

A draft model pays k draft steps per round; a block drafter pays ONE pass over
its block (the last token plus mask positions) whatever k, plus the catch-up
of the rows the target kept last round. So instead of a per-token step this
module measures that pass at every k the bench asks for (`drafter_passes`,
also used by the dflash_cost study) and redoes the context scaling with the
drafter's pass after each context length; its end-to-end runs go through the
loop from the prompt (endtoend.compare_from_prompt). The cost model is
`costmodel.predicted_block_speedup`; the verdict `recommend.block_verdict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import mlx.core as mx

from .. import costmodel
from ..drafters import DFlash2Drafter, DFlashDrafter
from ..memory import model_bytes
from ..sampling import SamplingConfig
from . import scaling
from .scaling import ContextPoint
from .timing import DEFAULT_REPEATS, interleaved_medians, ratio

SIZE_SCALING_SKIPPED = (
    "a DFlash drafter has the target's width and reads its hidden states, embedding and output "
    "head, so its pass cannot be held fixed while a synthetic target of another size grows")
MLX_LM_SKIPPED = ("mlx-lm's speculative mode cannot run a DFlash drafter (it reads the target's "
                  "hidden states): the mlx-lm column reads n/a")


@dataclass(frozen=True)
class BlockDrafterCost:
    """One round's drafter work, per k: the catch-up of the k + 1 rows a fully accepted round
    hands over, then the pass proposing k (one pass, whatever k)."""

    kind: str  # "DFlash block drafter" or "DFlash2 block drafter"
    weight_bytes: int
    block_size: int
    context_length: int
    rows_by_k: Dict[int, int] = field(default_factory=dict)  # k -> rows the pass runs
    pass_s: Dict[int, float] = field(default_factory=dict)  # k -> median seconds
    pass_cost: Dict[int, float] = field(default_factory=dict)  # k -> pass_s / target step
    block_s: Dict[int, float] = field(default_factory=dict)  # k -> the proposal alone


def kind(drafter) -> str:
    return "DFlash2 block drafter" if drafter.dflash_config.dflash2 else "DFlash block drafter"


def proposer(drafter, target_model, sampling: SamplingConfig = SamplingConfig()):
    """The drafter as the loop drives it (DFlash2Drafter for a DFlash2 layout)."""
    cls = DFlash2Drafter if drafter.dflash_config.dflash2 else DFlashDrafter
    return cls(drafter, target_model, sampling)


def block_ks(ks: Sequence[int], block_size: int) -> Tuple[int, ...]:
    """`ks` capped at the block's k + 1 <= block_size, with the whole block added."""
    top = block_size - 1
    return tuple(sorted({min(k, top) for k in ks} | {top}))


def drafter_passes(drafter, target_model, context: int, ks: Sequence[int],
                   seed: int = 1) -> Dict[Tuple[str, int], Callable[[], None]]:
    """{("block" | "round", k): a fn running one drafter pass} after `context` random tapped
    rows. `block`: the proposal alone (its rows through the drafter's layers, then the
    target's head over the k rows read); `round` adds the catch-up a round pays first (the
    k + 1 rows a fully accepted round hands over: fc and each layer's keys/values)."""
    config = drafter.dflash_config
    width = len(config.target_layer_ids) * config.hidden_size
    rows = mx.random.normal((context + max(ks) + 1, width), key=mx.random.key(seed)).astype(
        drafter.fc.weight.dtype)  # (context + k_max + 1, taps * H)
    mx.eval(rows)
    drafts = proposer(drafter, target_model)
    drafts.follow([], rows[:context])
    mx.eval(drafts.catch_up())
    history = [1] * context

    def block(k):
        def run():
            mx.eval(drafts.propose(history, k).tokens)
        return run

    def round_(k):  # the kept rows of a fully accepted round, then the proposal
        def run():
            drafts.follow([], rows[context:context + k + 1])
            mx.eval(drafts.propose(history + [1] * (k + 1), k).tokens, drafts.catch_up())
            drafts.context.truncate(context)
        return run

    return {**{("block", k): block(k) for k in ks}, **{("round", k): round_(k) for k in ks}}


def measure_drafter(drafter, target_model, target_step_s: float, ks: Sequence[int],
                    context_length: int, repeats: int = DEFAULT_REPEATS,
                    seed: int = 0) -> BlockDrafterCost:
    """The drafter's pass at every k after `context_length` rows, against one target step."""
    passes = drafter_passes(drafter, target_model, max(context_length, 1), ks, seed + 1)
    seconds: Dict[Hashable, float] = interleaved_medians(passes, repeats)
    cuttable = proposer(drafter, target_model).cuttable
    block_size = drafter.dflash_config.block_size
    return BlockDrafterCost(
        kind(drafter), model_bytes(drafter), block_size, context_length,
        rows_by_k={k: k + 1 if cuttable else block_size for k in ks},
        pass_s={k: seconds[("round", k)] for k in ks},
        pass_cost={k: ratio(seconds[("round", k)], target_step_s) for k in ks},
        block_s={k: seconds[("block", k)] for k in ks})


def context_scaling(target_model, drafter, acceptance: float, k: int, lengths: Sequence[int],
                    repeats: int = DEFAULT_REPEATS, seed: int = 0,
                    progress=None) -> List[ContextPoint]:
    """scaling.context_scaling with the drafter's round pass after each context length."""

    def pass_seconds(length):
        return measure_drafter(drafter, target_model, 1.0, [k], length, repeats, seed).pass_s[k]

    def predict(cost, curve):
        return costmodel.predicted_block_speedup(acceptance, k, {k: cost}, curve)

    return scaling.context_scaling(target_model, drafter, acceptance, k, lengths, repeats, seed,
                                   progress, pass_seconds, predict)


def repredict(point, acceptance: float, k: int):
    """A saved context point's prediction redone from its measurements."""
    curve = {1: 1.0, k + 1: point.verify_cost}
    return dataclasses.replace(point, predicted_speedup=costmodel.predicted_block_speedup(
        acceptance, k, {k: point.draft_cost}, curve))
