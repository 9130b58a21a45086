"""End-to-end decode tokens/s: the target alone, mlx-lm's speculative mode, and mlx-spec.

The methods run side by side in one process, interleaved within every repeat
(so a background load slows all of them alike), each on the same prompt with
its KV caches prefilled untimed: only decoding is timed, and every method
counts exactly `max_tokens` generated tokens. Medians over repeats after a
warm-up; the headline figures are ratios of medians.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.generate import speculative_generate_step as mlx_lm_speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..cache import make_cache
from ..generate import speculative_generate_step
from ..memory import wired_limit
from ..sampling import SamplingConfig
from .prompts import Prompt
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP, median, ratio, time_after_prefill

TARGET, MLX_LM, MLX_SPEC = "target alone", "mlx-lm speculative", "mlx-spec"
MLX_SPEC_DEFAULTS = "mlx-spec defaults"  # a drafter on the target's states, default policy
DEFAULT_E2E_TEMPS = (0.0, 1.0)


@dataclass(frozen=True)
class RunResult:
    seconds: float
    tokens: int
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class MethodResult:
    tokens_per_s: float  # median over repeats
    runs_tokens_per_s: tuple
    acceptance_rate: Optional[float]  # None for the target alone


@dataclass(frozen=True)
class Comparison:
    temp: float
    k: int
    max_tokens: int
    methods: Dict[str, MethodResult]
    ratios: Dict[str, float] = field(default_factory=dict)


def mlx_lm_can_speculate(target_model, draft_model) -> bool:
    """mlx-lm's speculative mode needs every cache layer of both models trimmable."""
    return can_trim_prompt_cache(make_cache(target_model) + make_cache(draft_model))


def _prefilled(model, ids: List[int]) -> list:
    """A cache holding all prompt tokens but the last (which the generator feeds)."""
    cache = make_cache(model)
    if len(ids) > 1:
        model(mx.array(ids[:-1], mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def run_target_alone(target_model, ids, temp, max_tokens) -> RunResult:
    cache, sampler = _prefilled(target_model, ids), make_sampler(temp)
    start, n = time.perf_counter(), 0
    for _token, _ in mlx_lm_generate_step(mx.array(ids[-1:], mx.uint32), target_model,
                                          max_tokens=max_tokens, sampler=sampler,
                                          prompt_cache=cache):
        n += 1
    return RunResult(time.perf_counter() - start, n)


def run_mlx_lm(target_model, draft_model, ids, temp, k, max_tokens) -> RunResult:
    cache = _prefilled(target_model, ids) + _prefilled(draft_model, ids)
    sampler = make_sampler(temp)
    start, n, accepted, drafted, round_starts = time.perf_counter(), 0, 0, 0, True
    for _token, _, from_draft in mlx_lm_speculative_generate_step(
        mx.array(ids[-1:], mx.uint32), target_model, draft_model, num_draft_tokens=k,
        max_tokens=max_tokens, sampler=sampler, prompt_cache=cache,
    ):
        if round_starts:  # mlx-lm drafts min(k, tokens still wanted) each round
            drafted += min(k, max_tokens - n)
        n += 1
        accepted += from_draft
        round_starts = not from_draft  # every round ends with one target token
    return RunResult(time.perf_counter() - start, n, drafted, accepted)


def run_mlx_spec(target_model, draft_model, ids, temp, k, max_tokens, accept=None) -> RunResult:
    cache = _prefilled(target_model, ids) + _prefilled(draft_model, ids)
    start, n, drafted, accepted = time.perf_counter(), 0, 0, 0
    for round_ in speculative_generate_step(
        ids[-1:], target_model, draft_model, max_tokens=max_tokens, num_draft_tokens=k,
        sampling=SamplingConfig(temp=temp), prompt_cache=cache, accept=accept,
        prompt_lookup=False,
    ):
        n += len(round_.tokens)
        drafted, accepted = drafted + round_.num_drafted, accepted + round_.num_accepted
        if n >= max_tokens:
            break
    return RunResult(time.perf_counter() - start, min(n, max_tokens), drafted, accepted)


def run_from_prompt(target_model, drafter, ids, temp, k: Optional[int], max_tokens,
                    each: Optional[Callable] = None, **options) -> RunResult:
    """One generation through mlx-spec's loop from the prompt (k None: the default policy), no
    prompt lookup, timed after its first round: a drafter that reads the target's hidden
    states (DFlash, EAGLE-3) is fed the prompt's in the prefill, so a cache prefilled outside
    the loop would leave it blind. `each(round)` sees every round (time_after_prefill's);
    `options` go to speculative_generate_step (e.g. tree=)."""
    decoded = time_after_prefill(speculative_generate_step(
        ids, target_model, drafter, max_tokens=max_tokens + 1, num_draft_tokens=k,
        sampling=SamplingConfig(temp=temp), prompt_lookup=False, **options), each)
    return RunResult(decoded.seconds, decoded.tokens, decoded.drafted, decoded.accepted)


def prompt_index(r: int, n_prompts: int) -> int:
    """The prompt of repeat r (warm-up repeats included)."""
    return r % n_prompts


def timed_prompts(prompts: Sequence[Prompt], repeats: int, warmup: int) -> List[str]:
    """Names of the prompts whose runs `interleave` times (the cost model compares on these)."""
    return [prompts[prompt_index(r, len(prompts))].name for r in range(warmup, warmup + repeats)]


def interleave(methods: Dict[str, Callable[[List[int]], RunResult]], prompts,
               repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP, seed: int = 0,
               progress: Optional[Callable[[str], None]] = None) -> Dict[str, MethodResult]:
    """Run every method once per repeat, in turn, on that repeat's prompt.

    The order reverses every other repeat (A B C, C B A, ...), so a method
    is not always the one that runs right after a given other, and a load
    that rises or falls through a repeat slows both ends alike.
    """
    tps: Dict[str, List[float]] = {name: [] for name in methods}
    counts = {name: [0, 0] for name in methods}
    names = list(methods)
    for r in range(warmup + repeats):
        ids = prompts[prompt_index(r, len(prompts))][1]
        if progress:
            progress(f"repeat {r + 1 - warmup}/{repeats}" if r >= warmup else "warm-up")
        for name in (names if r % 2 == 0 else names[::-1]):
            mx.random.seed(seed + r)
            result = methods[name](ids)
            if r < warmup:
                continue
            tps[name].append(ratio(result.tokens, result.seconds))
            counts[name][0] += result.drafted
            counts[name][1] += result.accepted
    return {
        name: MethodResult(median(tps[name]), tuple(tps[name]),
                           ratio(counts[name][1], counts[name][0]) if counts[name][0] else None)
        for name in methods
    }


def compare(target_model, draft_model, prompts, k: int, temp: float, max_tokens: int,
            repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP, seed: int = 0,
            progress=None, speculative=None, mlx_lm: bool = True) -> Comparison:
    """Target alone vs mlx-lm speculative vs mlx-spec at one (k, temp); `speculative`, when
    given, {name: run(ids)} replaces the last two (see compare_from_prompt);
    `mlx_lm` False leaves mlx-lm out (a draft of another tokenizer: its ids are not the
    target's)."""
    methods = {
        TARGET: lambda ids: run_target_alone(target_model, ids, temp, max_tokens),
        **(speculative or {
            MLX_LM: lambda ids: run_mlx_lm(target_model, draft_model, ids, temp, k, max_tokens),
            MLX_SPEC: lambda ids: run_mlx_spec(target_model, draft_model, ids, temp, k,
                                               max_tokens)}),
    }
    if MLX_LM in methods and not (mlx_lm and mlx_lm_can_speculate(target_model, draft_model)):
        del methods[MLX_LM]  # recurrent or sliding-window caches: mlx-lm refuses the pair
    with wired_limit(target_model, draft_model):
        results = interleave(methods, prompts, repeats, warmup, seed, progress)
    return comparison(temp, k, max_tokens, results)


def compare_from_prompt(target_model, drafter, prompts, k: int, temp: float, max_tokens: int,
                        *timing) -> Comparison:
    """Target alone vs mlx-spec with a drafter on the target's states at k vs with the
    defaults, interleaved (`run_from_prompt`; mlx-lm cannot run such a drafter); `timing`:
    repeats, warmup, seed, progress, as `compare` takes them."""
    return compare(target_model, drafter, prompts, k, temp, max_tokens, *timing, speculative={
        MLX_SPEC: lambda ids: run_from_prompt(target_model, drafter, ids, temp, k, max_tokens),
        MLX_SPEC_DEFAULTS: lambda ids: run_from_prompt(target_model, drafter, ids, temp, None,
                                                       max_tokens)})


def comparison(temp: float, k: int, max_tokens: int,
               results: Dict[str, MethodResult]) -> Comparison:
    """The methods' results and their ratios; a method that did not run reads 0 (n/a)."""
    results.setdefault(MLX_LM, MethodResult(0.0, (), None))
    tps = {name: r.tokens_per_s for name, r in results.items()}
    ratios = {
        "mlx-spec / target alone": ratio(tps[MLX_SPEC], tps[TARGET]),
        "mlx-spec / mlx-lm speculative": ratio(tps[MLX_SPEC], tps[MLX_LM]) or None,
        "mlx-lm speculative / target alone": ratio(tps[MLX_LM], tps[TARGET]) or None,
    }
    if MLX_SPEC_DEFAULTS in tps:
        ratios["mlx-spec defaults / target alone"] = ratio(tps[MLX_SPEC_DEFAULTS], tps[TARGET])
    return Comparison(temp, k, max_tokens, results, ratios)


def speedup_vs_k(target_model, draft_model, prompts, ks: Sequence[int], temp: float,
                 max_tokens: int, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                 seed: int = 0, progress=None, run_spec=run_mlx_spec) -> Dict[int, float]:
    """Measured mlx-spec / target-alone tokens/s for every k, all interleaved; `run_spec` runs
    mlx-spec once (`run_from_prompt` for a drafter on the target's states)."""
    methods = {TARGET: lambda ids: run_target_alone(target_model, ids, temp, max_tokens)}
    for k in ks:
        methods[f"k={k}"] = (lambda ids, k=k: run_spec(target_model, draft_model, ids,
                                                        temp, k, max_tokens))
    with wired_limit(target_model, draft_model):
        results = interleave(methods, prompts, repeats, warmup, seed, progress)
    base = results[TARGET].tokens_per_s
    return {k: ratio(results[f"k={k}"].tokens_per_s, base) for k in ks}
