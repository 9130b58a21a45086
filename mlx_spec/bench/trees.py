"""The bench's token-tree phase: the draft model's chain at k against its trees, measured and
predicted on this machine.

One interleaved race at T = 0 over the bench's prompts: the target alone, the draft model's
chain at k (`tree=False`), its trees of depth k and width 2 and 3 (a spine of k drafts with
width - 1 sibling leaves beside each spine node: k x width nodes in one verify pass,
`tree=(k, w)`), and mlx-spec's defaults (the policy chooses the width each round). Each
method's speed-up over the target alone, the tokens a verify pass emitted, the share of
passes that verified a tree, and `rescued`: of the tree rounds whose spine stopped short, the
share where a sibling kept a token (the b_w of the policy's E(k, w)).

The cost model's prediction for each shape on this machine, from the measured acceptance a,
the draft's step and the target's verify curve (`costmodel.predicted_tree_speedup`):

    speed-up(k, w) = E(k, w) / (k draft_cost + verify_cost(1 + k w)),
    E(k, w) = 1 + sum_{i<=k} a^(i-1) (a + (1 - a) b_w)

so a tree pays where the verify curve is flat enough that k (w - 1) more nodes cost less than
the tokens the siblings rescue: on an Apple-silicon GPU, not on a CPU with a reference BLAS.
It runs for a draft model of the target's tokenizer and for an EAGLE-3 head (its step the draft
step), on a target whose cache can verify a tree (`tree_verify.tree_capable`); otherwise the
result's `skipped["token trees"]` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from .. import costmodel
from ..cache import ModelCache, make_cache
from ..memory import wired_limit
from ..tree_verify import tree_capable
from .endtoend import TARGET, RunResult, interleave, run_from_prompt, run_target_alone
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP, ratio

WIDTHS = (2, 3)  # the tree widths raced against the chain (Macs measured best at 1-3)
DEFAULTS = "defaults"
TREES_NOT_VERIFIABLE = ("the target's cache cannot verify a token tree (recurrent state or a "
                        "chunked cache), so its drafts stay chains")


def chain_name(k: int) -> str:
    return f"chain k={k}"


def tree_name(k: int, width: int) -> str:
    return f"tree {k}x{width}"


@dataclass(frozen=True)
class TreeMethod:
    method: str  # "chain k=4", "tree 4x2", "defaults"
    width: int  # 1 for the chain; 0 for the defaults (the policy's choice)
    tokens_per_s: float
    speedup: float  # over the target alone
    tokens_per_pass: float
    tree_share: float  # verify passes that verified a tree
    rescued: Optional[float] = None  # b_w: tree rounds whose spine stopped short, a sibling kept
    predicted: Optional[float] = None  # the cost model's speed-up on this machine


@dataclass(frozen=True)
class TreeRace:
    temp: float
    k: int
    max_tokens: int
    results: List[TreeMethod] = field(default_factory=list)


def trees_verifiable(target_model) -> bool:
    """Whether the target's cache kinds can verify a token tree."""
    return tree_capable(ModelCache(target_model, make_cache(target_model)))


def race(target_model, draft_model, prompts, k: int, temp: float = 0.0, max_tokens: int = 128,
         repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP, seed: int = 0,
         progress: Optional[Callable[[str], None]] = None,
         widths: Sequence[int] = WIDTHS) -> TreeRace:
    """The chain at k, trees k x w and the defaults against the target alone, interleaved (the
    counts, as the timings, leave the warm-up runs out)."""
    counts: Dict[str, list] = {}  # method -> [passes, tokens, tree passes, stopped, rescued]

    def run(name: str, k_run: Optional[int], **options):
        counts[name], calls = [0, 0, 0, 0, 0], [0]

        def one(ids) -> RunResult:
            timed: list = []
            result = run_from_prompt(target_model, draft_model, ids, temp, k_run, max_tokens,
                                     timed.append, **options)
            calls[0] += 1
            if calls[0] > warmup:
                tally(counts[name], timed[1:])  # the first round carries the prefill, untimed
            return result

        return one

    methods = {TARGET: lambda ids: run_target_alone(target_model, ids, temp, max_tokens),
               chain_name(k): run(chain_name(k), k, tree=False)}
    for w in widths:
        methods[tree_name(k, w)] = run(tree_name(k, w), k, tree=(k, w))
    methods[DEFAULTS] = run(DEFAULTS, None)
    with wired_limit(target_model, draft_model):
        results = interleave(methods, prompts, repeats, warmup, seed, progress)
    plain = results[TARGET].tokens_per_s
    shapes = {chain_name(k): 1, **{tree_name(k, w): w for w in widths}, DEFAULTS: 0}
    return TreeRace(temp, k, max_tokens, [
        TreeMethod(name, width, results[name].tokens_per_s,
                   ratio(results[name].tokens_per_s, plain), ratio(c[1], c[0]), ratio(c[2], c[0]),
                   ratio(c[4], c[3]) if c[3] else None)
        for (name, width), c in ((item, counts[item[0]]) for item in shapes.items())])


def tally(count: list, rounds) -> None:
    """Add timed rounds to [passes, tokens, tree passes, spines stopped short, siblings kept]."""
    for round_ in rounds:
        count[0] += 1
        count[1] += len(round_.tokens)
        if round_.tree_nodes:
            count[2] += 1
            spine = round_.spine_kept
            if spine is not None and spine < (round_.spine_length or round_.num_drafted):
                count[3] += 1
                count[4] += round_.num_accepted > spine


def predict(race_: TreeRace, acceptance: float, draft_cost: float,
            verify_cost: Mapping[int, float]) -> TreeRace:
    """The race with each fixed shape's predicted speed-up on this machine: the measured
    per-draft acceptance, draft step and verify curve, and the shape's own measured b_w
    (a chain: none; a tree whose spine never stopped short: none, b_w = 0)."""
    def predicted(m: TreeMethod) -> Optional[float]:
        if m.width == 0:
            return None  # the defaults' shape changes round by round
        return costmodel.predicted_tree_speedup(acceptance, race_.k, m.width, m.rescued or 0.0,
                                                draft_cost, verify_cost)

    return replace(race_, results=[replace(m, predicted=predicted(m)) for m in race_.results])
