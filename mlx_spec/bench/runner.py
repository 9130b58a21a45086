"""`run_bench`: every measurement in order, one result object, no printing.

    result = run_bench(target_model, draft_model, tokenizer, quick_config())
    json.dumps(result.as_dict())

Phases: machine, bandwidth, per-model cost, acceptance sweep, end-to-end
comparison, speed-up vs k, cost-model verdict, scaling, drafting sources, and
for a draft model or an EAGLE-3 head the chain against its token trees (`trees`). `progress(message)`
is called as they go (the CLI prints it to stderr).

A DFlash block drafter as the draft takes `block_drafter`'s path through the
same phases: its pass per round instead of a draft step per token, its runs
at k and with the defaults, its whole block added to the k sweeps; what does
not apply to it is listed in `skipped` with the reason. A draft of another
tokenizer (its tokenizer kept by `mlx_spec.load`) takes every phase but mlx-lm's
speculative column. An EAGLE-3 head takes the draft model's path with its chained step as the
draft step (`head_drafter`), its runs from the prompt as a block drafter's, and skips mlx-lm's
column and the size scaling (listed in `skipped`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

from ..assemble import draft_bridge
from ..dflash import is_dflash_model
from ..eagle3 import is_eagle3_head
from ..policy import DEFAULT_NUM_DRAFT_TOKENS
from ..precision import prepare_drafter
from . import acceptance as acc
from . import block_drafter, endtoend, head_drafter, scaling, sources, trees
from .bandwidth import DEFAULT_BANDWIDTH_MB, Bandwidth, measure_bandwidth
from .forward import DEFAULT_CONTEXT_LENGTH, DEFAULT_VERIFY_LENGTHS, ModelCost, measure_model
from .machine import MachineInfo, machine_info
from .prompts import PROMPTS, QUICK_PROMPTS, Prompt, encode_prompts
from .recommend import Verdict, block_verdict, verdict
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP

DEFAULT_MAX_TOKENS = 128
DEFAULT_SPEEDUP_KS = (1, 2, 3, 4, 6, 8)
TREES_NOT_RACED = ("the bench races the trees of a draft model of the target's tokenizer and of "
                   "an EAGLE-3 head; a draft of another tokenizer drafts chains, and a DFlash "
                   "or DFlash2 drafter's trees run in generate and check --tree")
MLX_LM_FOREIGN = ("mlx-lm's speculative mode needs a draft of the target's tokenizer (it would "
                  "read the draft's ids as the target's): the mlx-lm column reads n/a")


@dataclass(frozen=True)
class BenchConfig:
    seed: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # k of the end-to-end comparison
    ks: Tuple[int, ...] = acc.DEFAULT_KS
    temps: Tuple[float, ...] = acc.DEFAULT_TEMPS
    token_match: bool = True
    e2e_temps: Tuple[float, ...] = endtoend.DEFAULT_E2E_TEMPS
    speedup_ks: Tuple[int, ...] = DEFAULT_SPEEDUP_KS
    verify_lengths: Tuple[int, ...] = DEFAULT_VERIFY_LENGTHS
    context_length: int = DEFAULT_CONTEXT_LENGTH
    context_lengths: Tuple[int, ...] = scaling.DEFAULT_CONTEXT_LENGTHS
    target_sizes: Tuple[Tuple[int, int], ...] = scaling.DEFAULT_TARGET_SIZES
    batch_sizes: Tuple[int, ...] = scaling.DEFAULT_BATCH_SIZES
    bandwidth_mb: int = DEFAULT_BANDWIDTH_MB
    prompts: Tuple[Prompt, ...] = PROMPTS
    sources_ks: Tuple[int, ...] = (2, 4, 6)  # fixed k raced against adaptive and lookup

    def timed_prompt_names(self) -> List[str]:
        """The prompts the end-to-end and speed-up-vs-k timings cycle through."""
        return endtoend.timed_prompts(self.prompts, self.repeats, self.warmup)


def quick_config(**overrides) -> BenchConfig:
    """A few minutes on a laptop CPU: fewer k, temperatures, prompts, sizes and repeats."""
    quick = dict(
        max_tokens=48, repeats=3, ks=(1, 2, 4), temps=(0.0, 1.0), speedup_ks=(2, 4),
        verify_lengths=(1, 2, 4, 8, 16), context_length=128, context_lengths=(64, 256),
        target_sizes=((256, 4), (512, 4)), batch_sizes=(1, 2, 4, 8), bandwidth_mb=128,
        prompts=QUICK_PROMPTS, sources_ks=(2, 4),
    )
    quick.update(overrides)
    return BenchConfig(**quick)


def tiny_config(**overrides) -> BenchConfig:
    """Seconds on tiny test models: every phase runs once, on almost nothing."""
    tiny = dict(
        max_tokens=8, repeats=1, warmup=1, num_draft_tokens=2, ks=(1, 2), temps=(0.0, 1.0),
        e2e_temps=(0.0, 1.0), speedup_ks=(1, 2), verify_lengths=(1, 2, 4), context_length=8,
        context_lengths=(4, 16), target_sizes=((32, 1), (64, 1)), batch_sizes=(1, 2),
        bandwidth_mb=8, prompts=QUICK_PROMPTS[:2], sources_ks=(1, 2),
    )
    tiny.update(overrides)
    return BenchConfig(**tiny)


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    models: Dict[str, str]
    machine: MachineInfo
    bandwidth: Bandwidth
    target: ModelCost
    draft: Optional[ModelCost]  # None for a block drafter: see block_drafter
    acceptance: List[acc.AcceptancePoint]
    end_to_end: List[endtoend.Comparison]
    speedup_vs_k: Dict[int, float]  # measured mlx-spec / target alone at T = 0
    verdicts: List[Verdict]
    context_scaling: List[scaling.ContextPoint]
    size_scaling: List[scaling.SizePoint]
    batch_scaling: scaling.BatchScaling
    sources: Optional[sources.SourcesRace] = None
    elapsed_s: float = 0.0
    notes: List[str] = field(default_factory=list)
    block_drafter: Optional[block_drafter.BlockDrafterCost] = None  # a DFlash drafter's pass
    skipped: Dict[str, str] = field(default_factory=dict)  # phase -> why it did not run
    head: Optional[str] = None  # the kind of a head drafting step by step (EAGLE-3), or None
    tree_race: Optional[trees.TreeRace] = None  # the draft model's chain against its trees

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_bench(target_model, draft_model, tokenizer, config: BenchConfig = BenchConfig(),
              models: Optional[Dict[str, str]] = None,
              progress: Optional[Callable[[str], None]] = None) -> BenchResult:
    say = progress or (lambda message: None)
    start = time.perf_counter()
    prepare_drafter(draft_model, target_model)  # measured in the dtype generation drafts in
    block, head = is_dflash_model(draft_model), is_eagle3_head(draft_model)
    from_prompt = block or head  # drafters on the target's states: their runs start from it
    foreign = not from_prompt and draft_bridge(target_model, draft_model, tokenizer) is not None
    notes, skipped = [], {}
    if block:
        config, notes = block_config(config, draft_model.dflash_config.block_size)
        skipped = {"size scaling": block_drafter.SIZE_SCALING_SKIPPED,
                   "mlx-lm speculative": block_drafter.MLX_LM_SKIPPED}
    if head:
        skipped = dict(head_drafter.SKIPPED)
    if foreign:
        skipped = {"mlx-lm speculative": MLX_LM_FOREIGN}
    prompts = encode_prompts(tokenizer, config.prompts)
    k, seed, repeats = config.num_draft_tokens, config.seed, config.repeats

    say("[1/10] machine")
    machine = machine_info()
    say("[2/10] memory bandwidth")
    bandwidth = measure_bandwidth(config.bandwidth_mb, repeats)
    say("[3/10] per-model cost and verify-cost curve"
        + (" (the drafter: its pass per round at each k)" if block else ""))
    costs = {
        role: measure_model(role, model, bandwidth.read_gbs, config.verify_lengths,
                            config.context_length, repeats, seed)
        for role, model in (("target", target_model), ("draft", draft_model))
        if role == "target" or not from_prompt
    }
    if head:
        costs["draft"] = head_drafter.head_cost(target_model, draft_model, bandwidth.read_gbs,
                                                config.context_length, repeats)
    drafter = block_drafter.measure_drafter(
        draft_model, target_model, costs["target"].decode_s, sorted(verdict_ks(config) | {k}),
        config.context_length, repeats, seed) if block else None
    say("[4/10] acceptance sweep")
    points = acc.measure_acceptance(target_model, draft_model, prompts, config.ks, config.temps,
                                    config.max_tokens, seed, config.token_match, say)
    say("[5/10] end to end: target alone vs "
        + ("mlx-spec at k and with the defaults" if from_prompt
           else "mlx-lm speculative vs mlx-spec"))
    compare = endtoend.compare_from_prompt if from_prompt else partial(endtoend.compare,
                                                                       mlx_lm=not foreign)
    comparisons = [
        compare(target_model, draft_model, prompts, k, temp, config.max_tokens,
                repeats, config.warmup, seed, lambda m, t=temp: say(f"T={t}: {m}"))
        for temp in config.e2e_temps
    ]
    say("[6/10] measured speed-up vs k (T=0)")
    by_k = endtoend.speedup_vs_k(target_model, draft_model, prompts, config.speedup_ks, 0.0,
                                 config.max_tokens, repeats, config.warmup, seed, say,
                                 endtoend.run_from_prompt if from_prompt
                                 else endtoend.run_mlx_spec)
    say("[7/10] cost model")
    verdicts = cost_model_verdicts(config, points, costs["target"], costs.get("draft"),
                                   comparisons, by_k, drafter)
    say("[8/10] scaling: context length, target size, batch size")
    acceptance0 = scaling_acceptance(config, points)
    if block:
        context = block_drafter.context_scaling(target_model, draft_model, acceptance0, k,
                                                config.context_lengths, repeats, seed, say)
        sizes = []
    elif head:
        context = scaling.context_scaling(
            target_model, draft_model, acceptance0, k, config.context_lengths, repeats, seed,
            say, head_drafter.step_seconds(target_model, draft_model, repeats))
        sizes = []
    else:
        context = scaling.context_scaling(target_model, draft_model, acceptance0, k,
                                          config.context_lengths, repeats, seed, say)
        sizes = scaling.size_scaling(draft_model, target_model, costs["draft"].decode_s,
                                     acceptance0, k, bandwidth.read_gbs, config.context_length,
                                     config.target_sizes, repeats, seed, say)
    batch = scaling.batch_scaling(target_model, k, config.context_length, config.batch_sizes,
                                  repeats, seed)
    say("[9/10] drafting sources: plain, fixed k, adaptive, prompt lookup")
    race = sources.race(target_model, draft_model, prompts, config.sources_ks, 0.0,
                        config.max_tokens, repeats, config.warmup, seed, say)
    race_trees = None
    if block or foreign:
        skipped["token trees"] = TREES_NOT_RACED
    elif not trees.trees_verifiable(target_model):
        skipped["token trees"] = trees.TREES_NOT_VERIFIABLE
    else:
        say(f"[10/10] token trees: the chain at k={k} against trees {k}x2 and {k}x3 and the "
            "defaults (T=0)")
        race_trees = trees.predict(
            trees.race(target_model, draft_model, prompts, k, 0.0, config.max_tokens, repeats,
                       config.warmup, seed, lambda m: say(f"trees: {m}")),
            acceptance0, costs["draft"].decode_s / costs["target"].decode_s,
            costs["target"].verify_cost)
    return BenchResult(
        config=config, models=dict(models or {}), machine=machine, bandwidth=bandwidth,
        target=costs["target"], draft=costs.get("draft"), acceptance=points,
        end_to_end=comparisons, speedup_vs_k=by_k, verdicts=verdicts,
        context_scaling=context, size_scaling=sizes, batch_scaling=batch, sources=race,
        elapsed_s=time.perf_counter() - start, notes=notes, block_drafter=drafter,
        skipped=skipped, head=head_drafter.KIND if head else None, tree_race=race_trees,
    )


def block_config(config: BenchConfig, block_size: int) -> Tuple[BenchConfig, List[str]]:
    """A block drafter's config: every k capped at its block (k + 1 <= block_size), the whole
    block added to the k sweeps; and notes saying so."""
    top = block_size - 1
    capped = dataclasses.replace(
        config, ks=block_drafter.block_ks(config.ks, block_size),
        speedup_ks=block_drafter.block_ks(config.speedup_ks, block_size),
        sources_ks=block_drafter.block_ks(config.sources_ks, block_size),
        num_draft_tokens=min(config.num_draft_tokens, top))
    notes = [f"The draft is a DFlash block drafter (block of {block_size}): k={top}, its whole "
             "block, joins the k sweeps, and no k goes beyond it."]
    if capped.num_draft_tokens != config.num_draft_tokens:
        notes.append(f"k of the end-to-end comparison capped at {top} (was "
                     f"{config.num_draft_tokens}): the block holds no more drafts.")
    return capped, notes


def verdict_ks(config: BenchConfig) -> set:
    """Every k the verdict predicts."""
    return set(config.ks) | set(config.speedup_ks)


def cost_model_verdicts(config: BenchConfig, points, target: ModelCost,
                        draft: Optional[ModelCost], comparisons, by_k,
                        drafter: Optional[block_drafter.BlockDrafterCost] = None) -> List[Verdict]:
    """One verdict per temperature: predicted speed-up per k next to the measured one
    (`drafter`: a block drafter's pass instead of `draft`'s step)."""
    verdicts = []
    timed = config.timed_prompt_names()
    ks = sorted(verdict_ks(config))
    for temp in config.temps:
        measured = dict(by_k) if temp == 0 else {
            c.k: c.ratios["mlx-spec / target alone"] for c in comparisons if c.temp == temp}
        if drafter is not None:
            verdicts.append(block_verdict(points, target, drafter.pass_cost, temp, ks, measured,
                                          timed))
        else:
            verdicts.append(verdict(points, target, draft, temp, ks, measured, timed))
    return verdicts


def scaling_acceptance(config: BenchConfig, points) -> float:
    """Per-draft acceptance used to predict the scaling figures (k of the comparison, T=0)."""
    point = acc.lookup(points, config.num_draft_tokens, 0.0) if 0.0 in config.temps else None
    return acc.iid_rate([point] if point else
                        [p for p in points if p.temp == config.temps[0] and p.rule == "exact"])


def recompute_predictions(result: BenchResult) -> BenchResult:
    """Re-derive every cost-model figure of a saved result from its measurements."""
    from .. import costmodel

    config = result.config
    k, a = config.num_draft_tokens, scaling_acceptance(config, result.acceptance)

    def predicted(point):
        if result.block_drafter is not None:
            return block_drafter.repredict(point, a, k)
        curve = {1: 1.0, k + 1: point.verify_cost}
        return dataclasses.replace(
            point, predicted_speedup=costmodel.predicted_speedup(a, k, point.draft_cost, curve))

    return dataclasses.replace(
        result,
        verdicts=cost_model_verdicts(config, result.acceptance, result.target, result.draft,
                                     result.end_to_end, result.speedup_vs_k,
                                     result.block_drafter),
        context_scaling=[predicted(p) for p in result.context_scaling],
        size_scaling=[predicted(p) for p in result.size_scaling],
        tree_race=None if result.tree_race is None else trees.predict(
            result.tree_race, a, result.draft.decode_s / result.target.decode_s,
            result.target.verify_cost),
    )
