"""Is mlx-spec ever behind plain decoding or mlx-lm's best fixed k? One table over the pair zoo.

Run from the repository root:

    python -m bench.studies.never_behind            # every pair, T = 0 / 0.7 / 1
    python -m bench.studies.never_behind --quick    # one repeat, fewer k and T
    python -m bench.studies.never_behind --pairs weak,strong --temps 0 --repeats 5
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m bench.studies.never_behind        # the same with OpenBLAS
    python -m bench.studies.never_behind --rerender bench/results/never-behind-....json

Writes bench/results/never-behind-<machine>-<blas>.json and .md (the BLAS
library MLX actually loaded; --out another path); progress goes to stderr.
The pairs: bench/zoo.py.

Time on the 2-core development CPU (netlib BLAS, quiet machine): the full
run (4 pairs x 3 T, 8 table repeats, 3 sweep repeats, 64 tokens, copy task)
took 30 minutes; --quick (one repeat) a few minutes.

What is measured, and how: for each pair and temperature T, two interleaved
phases in one process:

1. sweep: every fixed setting a user could pick instead of the defaults:
   plain decoding, prompt lookup alone, and mlx-spec at each fixed k with the
   pair's drafter and no lookup; beside them (reported, never the bar)
   mlx-lm's speculative_generate_step at each k, where mlx-lm can run the
   pair. The best fixed setting is the fastest of the first three kinds;
2. table: plain decoding, the best fixed setting, mlx-lm at its best k, and
   mlx-spec's defaults without and with a calibration, measured again.

Every compared figure comes from phase 2: the best fixed setting is
measured again rather than taken from the sweep, whose best median is the
luckiest of several noisy ones. A ratio is the median of the per-repeat
ratios (both methods ran on the same prompt in the same repeat), with a
distribution-free confidence interval for it beside it (order statistics,
~93% with 8 repeats), so a reader sees whether 0.97x is noise.

Pairs are tuned (the policy's constants were chosen looking at them) or
held out (only measured; bench/zoo.py); the table marks which.

Timing: plain and mlx-lm decode from caches prefilled untimed
(endtoend.py). Every mlx-spec method gets the whole prompt, since prompt
lookup reads it, and is timed from the end of its first round, which carries
the prefill (as sources.py). A copy task per pair at T = 0 (the target's own
greedy continuation, then its opening again) measures prompt lookup alone
and the defaults against plain decoding, with tokens per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step as mlx_lm_generate_step

from mlx_spec.cache import make_cache
from mlx_spec.generate import speculative_generate_step
from mlx_spec.memory import wired_limit
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.endtoend import (MethodResult, RunResult, interleave, mlx_lm_can_speculate, run_mlx_lm,
                        run_target_alone)
from mlx_spec.bench.machine import MachineInfo, machine_info
from mlx_spec.bench.prompts import PROMPTS, Prompt, encode_prompts
from mlx_spec.bench.serialize import from_dict
from mlx_spec.bench.timing import DEFAULT_WARMUP, median, median_interval, ratio, time_after_prefill
from ..zoo import HELD_OUT_NAMES, TUNED_NAMES, ZOO_NAMES, Pair, build_zoo
from . import RESULTS_DIR

PLAIN, LM_AT_K, BEST_FIXED = "plain", "mlx-lm@k", "best fixed"
DEFAULTS, DEFAULTS_CAL, LOOKUP = "defaults", "defaults+cal", "lookup"
DEFAULT_KS = (1, 2, 3, 4, 6, 8)  # mlx-spec's fixed k (the policy's cap is 8)
DEFAULT_LM_KS = (1, 2, 3, 4)  # mlx-lm's, beside (its best k was <= 4 on every row before)
DEFAULT_TEMPS = (0.0, 0.7, 1.0)
DEFAULT_PROMPTS = ("class_init", "parse_args", "rename")
COPY_SOURCE_PROMPT, COPY_CONTINUATION_TOKENS = "fibonacci", 96


@dataclass(frozen=True)
class NeverBehindConfig:
    temps: Tuple[float, ...] = DEFAULT_TEMPS
    ks: Tuple[int, ...] = DEFAULT_KS
    lm_ks: Tuple[int, ...] = DEFAULT_LM_KS
    max_tokens: int = 96
    repeats: int = 8  # the table's; its ratios' intervals need several (8: ~93%)
    sweep_repeats: int = 3  # mlx-lm's sweep over k only picks the k the table re-measures
    warmup: int = DEFAULT_WARMUP
    prompts: Tuple[str, ...] = DEFAULT_PROMPTS
    seed: int = 0
    copy_task: bool = True
    calibrate: bool = True


@dataclass(frozen=True)
class Ratio:
    value: float  # median of the per-repeat ratios
    low: float  # confidence interval for that median (order statistics of the ratios)
    high: float
    coverage: float = 0.0  # the interval's confidence (0.0 in results from before it was kept)


def spec_at(k: int) -> str:
    return f"mlx-spec k={k}"


def lm_at(k: int) -> str:
    return f"mlx-lm k={k}"


@dataclass(frozen=True)
class Row:
    pair: str
    temp: float
    sweep: Dict[str, float]  # the sweep's median tokens/s per setting (spec_at, lm_at, ...)
    best_fixed: str  # the sweep's fastest of PLAIN, LOOKUP and spec_at(k), measured again
    best_k: Optional[int]  # mlx-lm's best k (None: mlx-lm cannot run the pair)
    methods: Dict[str, MethodResult]  # LM_AT_K and DEFAULTS_CAL absent when not measured
    ratios: Dict[str, Optional[Ratio]]
    held_out: bool = False


@dataclass(frozen=True)
class CopyRow:
    pair: str
    prompt_tokens: int
    methods: Dict[str, MethodResult]
    tokens_per_round: Dict[str, float]
    ratios: Dict[str, Optional[Ratio]]


@dataclass(frozen=True)
class NeverBehind:
    config: NeverBehindConfig
    machine: MachineInfo
    pairs: Dict[str, str]  # name -> note
    held_out: List[str]  # the pairs the policy was never tuned on
    calibration: str  # "used", or why the with-calibration column is n/a
    calibration_s: Dict[str, float]  # pair -> seconds calibrate() took
    rows: List[Row]
    copy_rows: List[CopyRow] = field(default_factory=list)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def paired_ratio(a: Optional[MethodResult], b: Optional[MethodResult]) -> Optional[Ratio]:
    """a / b: the median of the per-repeat ratios and its confidence interval (None when
    either is missing). Paired: a load that slows one repeat slows both of its runs."""
    if a is None or b is None or not a.tokens_per_s or not b.tokens_per_s:
        return None
    per_repeat = [x / y for x, y in zip(a.runs_tokens_per_s, b.runs_tokens_per_s) if y]
    if not per_repeat:
        value = a.tokens_per_s / b.tokens_per_s
        return Ratio(value, value, value)
    low, high, coverage = median_interval(per_repeat)
    return Ratio(median(per_repeat), low, high, coverage)


def row_ratios(methods: Dict[str, MethodResult]) -> Dict[str, Optional[Ratio]]:
    """The table's ratios: the defaults against plain and the best fixed setting, and the
    best fixed setting against mlx-lm at its best k (None where a method was not run)."""
    ratios = {"best fixed / mlx-lm@k": paired_ratio(methods[BEST_FIXED], methods.get(LM_AT_K))}
    for name in (DEFAULTS, DEFAULTS_CAL):
        ratios[f"{name} / plain"] = paired_ratio(methods.get(name), methods[PLAIN])
        ratios[f"{name} / best fixed"] = paired_ratio(methods.get(name), methods[BEST_FIXED])
    return ratios


def fixed_settings(pair: Pair, temp: float, ks: Sequence[int], max_tokens: int,
                   lm_ks: Sequence[int] = ()) -> Dict[str, Callable]:
    """Every fixed setting the sweep times: plain, lookup alone, mlx-spec at each k (the
    pair's drafter, no lookup) and mlx-lm at each of `lm_ks`."""
    target_model, draft_model, n = pair.target_model, pair.draft_model, max_tokens
    settings = {
        PLAIN: lambda ids: run_target_alone(target_model, ids, temp, n),
        LOOKUP: lambda ids: run_defaults(target_model, None, ids, temp, n, prompt_lookup=True),
    }
    for k in ks:
        settings[spec_at(k)] = (lambda ids, k=k: run_defaults(
            target_model, draft_model, ids, temp, n, num_draft_tokens=k, prompt_lookup=False,
            **pair.draft_options))
    for k in lm_ks:
        settings[lm_at(k)] = (lambda ids, k=k: run_mlx_lm(target_model, draft_model, ids,
                                                          temp, k, n))
    return settings


def mlx_lm_runs(pair: Pair) -> bool:
    """Whether mlx-lm's speculative mode can decode the pair: not an MTP head, and caches it
    can trim; a sliding window cannot be trimmed once the prompt fills it, so never."""
    if isinstance(pair.draft_model, str):
        return False
    caches = make_cache(pair.target_model) + make_cache(pair.draft_model)
    return (mlx_lm_can_speculate(pair.target_model, pair.draft_model)
            and not any(type(c).__name__ == "RotatingKVCache" for c in caches))


def best_of(sweep: Dict[str, float], names) -> Optional[str]:
    names = [name for name in names if name in sweep]
    return max(names, key=sweep.get) if names else None


def calibration_unavailable() -> Optional[str]:
    """Why no calibration can be passed to speculative_generate_step yet, or None."""
    if "calibration" not in inspect.signature(speculative_generate_step).parameters:
        return "speculative_generate_step takes no calibration argument yet"
    try:
        from mlx_spec.bench.calibrate import calibrate  # noqa: F401
    except ImportError:
        return "mlx_spec.bench.calibrate is not there yet"
    return None


def run_defaults(target_model, draft_model, ids, temp, max_tokens, rounds_log=None,
                 **options) -> RunResult:
    """mlx-spec on the whole prompt, timed from the end of its first round (the prefill's).

    `rounds_log`, when given, gets (tokens, rounds) of the timed part.
    """
    decoded = time_after_prefill(speculative_generate_step(
        ids, target_model, draft_model, max_tokens=max_tokens,
        sampling=SamplingConfig(temp=temp), **options))
    if rounds_log is not None:
        rounds_log.append((decoded.tokens, decoded.rounds))
    return RunResult(decoded.seconds, decoded.tokens, decoded.drafted, decoded.accepted)


def _defaults_methods(pair: Pair, temp: float, max_tokens: int, calibration,
                      takes_calibration: bool,
                      logs: Optional[Dict[str, list]] = None) -> Dict[str, Callable]:
    """DEFAULTS (calibration=None where the argument exists) and, given one, DEFAULTS_CAL."""
    logs = logs if logs is not None else {}
    variants = {DEFAULTS: {"calibration": None} if takes_calibration else {}}
    if calibration is not None:
        variants[DEFAULTS_CAL] = {"calibration": calibration}
    return {name: (lambda ids, options=options, name=name: run_defaults(
        pair.target_model, pair.draft_model, ids, temp, max_tokens, logs.get(name),
        **pair.draft_options, **options))
        for name, options in variants.items()}


def _labelled(progress, label: str):
    return (lambda message: progress(f"{label}: {message}")) if progress else None


def measure_row(pair: Pair, prompts, temp: float, config: NeverBehindConfig, calibration,
                takes_calibration: bool, progress=None) -> Row:
    """Phase 1 (the sweep over fixed settings), then phase 2 (the table) for one pair and T."""
    timing = dict(repeats=config.repeats, warmup=config.warmup, seed=config.seed)
    label = f"{pair.name}, T={temp:g}"
    mlx_lm = mlx_lm_runs(pair)
    settings = fixed_settings(pair, temp, config.ks, config.max_tokens,
                              config.lm_ks if mlx_lm else ())
    swept = interleave(settings, prompts, progress=_labelled(progress, f"{label}, sweep"),
                       **{**timing, "repeats": config.sweep_repeats})
    sweep = {name: r.tokens_per_s for name, r in swept.items()}
    best_fixed = best_of(sweep, [PLAIN, LOOKUP] + [spec_at(k) for k in config.ks])
    best_lm = best_of(sweep, [lm_at(k) for k in config.lm_ks])
    methods = {PLAIN: settings[PLAIN], BEST_FIXED: settings[best_fixed]}
    if best_lm is not None:
        methods[LM_AT_K] = settings[best_lm]
    methods.update(_defaults_methods(pair, temp, config.max_tokens, calibration,
                                     takes_calibration))
    results = interleave(methods, prompts,
                         progress=_labelled(progress, f"{label}, best fixed {best_fixed}"),
                         **timing)
    best_k = int(best_lm.split("=")[1]) if best_lm else None
    return Row(pair.name, temp, sweep, best_fixed, best_k, results, row_ratios(results),
               pair.held_out)


def copy_prompt(pair: Pair, source: Prompt, continuation_tokens: int = COPY_CONTINUATION_TOKENS):
    """Token ids of: opening + the target's greedy continuation + blank line + opening again."""
    opening = list(pair.tokenizer.encode(source.text))
    continuation = []
    for token, _ in mlx_lm_generate_step(mx.array(opening, mx.uint32), pair.target_model,
                                         max_tokens=continuation_tokens):
        if token in pair.tokenizer.eos_token_ids:
            break
        continuation.append(int(token))
    blank = list(pair.tokenizer.encode("\n\n", add_special_tokens=False))
    return opening + continuation + blank + opening


def measure_copy(pair: Pair, config: NeverBehindConfig, calibration, takes_calibration: bool,
                 progress=None) -> CopyRow:
    """Prompt lookup on text the target is about to repeat, at T = 0."""
    source = next(p for p in PROMPTS if p.name == COPY_SOURCE_PROMPT)
    copy_ids = copy_prompt(pair, source)
    target_model, n = pair.target_model, config.max_tokens
    logs = {LOOKUP: [], DEFAULTS: [], DEFAULTS_CAL: []}
    methods = {
        PLAIN: lambda ids: run_target_alone(target_model, ids, 0.0, n),
        LOOKUP: lambda ids: run_defaults(target_model, None, ids, 0.0, n, logs[LOOKUP],
                                         prompt_lookup=True),
        **_defaults_methods(pair, 0.0, n, calibration, takes_calibration, logs),
    }
    results = interleave(methods, [(source, copy_ids)], repeats=config.repeats,
                         warmup=config.warmup, seed=config.seed,
                         progress=_labelled(progress, f"{pair.name}, copy task"))
    per_round = {}
    for name, log in logs.items():
        timed = log[config.warmup:]
        if timed:
            per_round[name] = ratio(sum(tokens for tokens, _ in timed),
                                    sum(rounds for _, rounds in timed))
    ratios = {f"{name} / plain": paired_ratio(results[name], results[PLAIN])
              for name in results if name != PLAIN}
    return CopyRow(pair.name, len(copy_ids), results, per_round, ratios)


def measure(pairs: Sequence[Pair], config: NeverBehindConfig = NeverBehindConfig(),
            progress: Optional[Callable[[str], None]] = None,
            checkpoint: Optional[Callable[[NeverBehind], None]] = None) -> NeverBehind:
    """Every row of the table (and the copy task) for every pair, in one process;
    `checkpoint(result so far)` after each pair (a long run keeps what it measured)."""
    say = progress or (lambda message: None)
    start = time.perf_counter()
    missing = calibration_unavailable()
    takes_calibration = missing is None
    if takes_calibration and not config.calibrate:
        missing = "turned off for this run"
    by_name = {p.name: p for p in PROMPTS}
    unknown = [name for name in config.prompts if name not in by_name]
    if unknown:
        raise ValueError(f"Unknown prompt {unknown[0]!r}; choose from {', '.join(by_name)}.")
    chosen = [by_name[name] for name in config.prompts]
    rows, copy_rows, calibration_s = [], [], {}
    for pair in pairs:
        prompts = encode_prompts(pair.tokenizer, chosen)
        mtp = pair.draft_model == "mtp"
        calibration = None
        if missing is None:
            say(f"{pair.name}: calibrating")
            began = time.perf_counter()
            from mlx_spec.bench.calibrate import calibrate
            calibration = calibrate(pair.target_model, None if mtp else pair.draft_model,
                                    pair.tokenizer, mtp=mtp,
                                    mtp_weights=pair.draft_options.get("mtp_weights"))
            calibration_s[pair.name] = time.perf_counter() - began
        with wired_limit(pair.target_model, *([] if mtp else [pair.draft_model])):
            for temp in config.temps:
                rows.append(measure_row(pair, prompts, temp, config, calibration,
                                        takes_calibration, progress))
            if config.copy_task:
                copy_rows.append(measure_copy(pair, config, calibration, takes_calibration,
                                              progress))
        if checkpoint is not None:
            done = pairs[:pairs.index(pair) + 1]
            checkpoint(NeverBehind(config, machine_info(), {p.name: p.note for p in done},
                                   [p.name for p in done if p.held_out], missing or "used",
                                   calibration_s, list(rows), list(copy_rows),
                                   time.perf_counter() - start))
    return NeverBehind(config, machine_info(), {p.name: p.note for p in pairs},
                       [p.name for p in pairs if p.held_out], missing or "used", calibration_s,
                       rows, copy_rows,
                       time.perf_counter() - start)


def _x(r: Optional[Ratio]) -> str:
    return "n/a" if r is None else f"{r.value:.2f}x ({r.low:.2f}-{r.high:.2f})"


def _tps(m: Optional[MethodResult]) -> str:
    return "n/a" if m is None else f"{m.tokens_per_s:.1f}"


def _pct(m: Optional[MethodResult]) -> str:
    return "-" if m is None or m.acceptance_rate is None else f"{m.acceptance_rate:.0%}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(row) + " |" for row in rows] + [""])


def _behind(result: NeverBehind) -> List[str]:
    """Ratios whose whole confidence interval lies below 1.0x, not just the median."""
    return [f"{row.pair}, T={row.temp:g}: {name} {_x(r)}" for row in result.rows
            for name, r in row.ratios.items() if r is not None and r.high < 1.0]


def _main_table(rows: Sequence[Row]) -> List[str]:
    lines = []
    for row in rows:
        ms, rs = row.methods, row.ratios
        lm = "-" if row.best_k is None else f"{row.best_k}: {_tps(ms.get(LM_AT_K))}"
        lines.append([row.pair, f"{row.temp:g}", _tps(ms[PLAIN]),
                      f"{row.best_fixed}: {_tps(ms[BEST_FIXED])}", lm,
                      _x(rs["best fixed / mlx-lm@k"]),
                      f"{_tps(ms[DEFAULTS])} / {_tps(ms.get(DEFAULTS_CAL))}",
                      f"{_x(rs['defaults / plain'])} / {_x(rs['defaults+cal / plain'])}",
                      f"{_x(rs['defaults / best fixed'])} / "
                      f"{_x(rs['defaults+cal / best fixed'])}",
                      " / ".join(_pct(ms.get(name)) for name in
                                 (BEST_FIXED, DEFAULTS, DEFAULTS_CAL))])
    return _table(("pair", "T", "plain tok/s", "best fixed: tok/s", "mlx-lm best k: tok/s",
                   "best fixed ÷ mlx-lm", "defaults tok/s (no cal / cal)",
                   "defaults ÷ plain (no cal / cal)", "defaults ÷ best fixed (no cal / cal)",
                   "acceptance (best fixed / defaults / +cal)"), lines)


def _worst(rows: Sequence[Row], name: str) -> str:
    values = [(row.ratios[name], row) for row in rows if row.ratios.get(name)]
    if not values:
        return "n/a"
    r, row = min(values, key=lambda v: v[0].value)
    return f"{_x(r)} ({row.pair}, T={row.temp:g})"


def plain_twice(rows: Sequence[Row]) -> List[Ratio]:
    """The A/A control: where the best fixed setting is plain decoding, the best fixed column
    is plain decoding timed a second time, so best fixed / plain measures the table's own
    noise (what a ratio of two identical methods reads)."""
    return [r for r in (paired_ratio(row.methods.get(BEST_FIXED), row.methods.get(PLAIN))
                        for row in rows if row.best_fixed == PLAIN) if r is not None]


def aa_control_line(rows: Sequence[Row]) -> List[str]:
    control = plain_twice(rows)
    if not control:
        return []
    values = sorted(r.value for r in control)
    rows_ = "row" if len(control) == 1 else f"{len(control)} rows"
    return [f"A/A control (the {rows_} whose best fixed setting is plain decoding, "
            f"so that column is plain decoding timed again): best fixed ÷ plain "
            f"{values[0]:.2f}x to {values[-1]:.2f}x, intervals "
            f"{min(r.low for r in control):.2f} to {max(r.high for r in control):.2f}: "
            f"two identical methods read this far apart here.", ""]


def render_markdown(result: NeverBehind) -> str:
    m, c = result.machine, result.config
    out = ["# Never behind: mlx-spec's defaults against plain decoding and the best fixed setting",
           "",
           f"- Machine: {m.chip}, {m.cpu_count} cores, MLX device {m.mlx_device}, BLAS {m.blas}, "
           f"MLX {m.mlx_version}, mlx-lm {m.mlx_lm_version}.",
           f"- {c.max_tokens} tokens per run, median of {c.repeats} interleaved repeats after "
           f"{c.warmup} warm-up (the order reversed every other repeat), prompts "
           f"{', '.join(c.prompts)} (one per repeat, in turn); the sweep of fixed settings "
           f"(plain, lookup alone, mlx-spec at k = {', '.join(map(str, c.ks))}; beside them "
           f"mlx-lm at k = {', '.join(map(str, c.lm_ks))}) ran {c.sweep_repeats} repeats.",
           f"- Calibration: {result.calibration}"
           + "".join(f"; {name} {s:.1f} s" for name, s in result.calibration_s.items()) + ".",
           ""]
    held_out = set(result.held_out)
    out += _table(("pair", "half", "what"),
                  [[name, "held out" if name in held_out else "tuned", note]
                   for name, note in result.pairs.items()])
    halves = [("Tuned pairs (the policy's constants were chosen looking at these)",
               [row for row in result.rows if row.pair not in held_out]),
              ("Held-out pairs (only measured, never tuned on)",
               [row for row in result.rows if row.pair in held_out])]
    for title, rows in halves:
        if not rows:
            continue
        out += [f"## {title}", ""] + _main_table(rows)
        out += [f"Worst: defaults ÷ best fixed {_worst(rows, 'defaults / best fixed')} "
                f"uncalibrated, {_worst(rows, 'defaults+cal / best fixed')} calibrated; "
                f"defaults ÷ plain {_worst(rows, 'defaults / plain')} uncalibrated, "
                f"{_worst(rows, 'defaults+cal / plain')} calibrated.", ""]
        out += aa_control_line(rows)
    coverage = max((r.coverage for row in result.rows for r in row.ratios.values() if r),
                   default=0.0)
    interval = (f"a {coverage:.0%} confidence interval for that median (order statistics, "
                "no assumption on the distribution)")
    out += [(f"- A ratio is the median of the per-repeat ratios (paired: both runs of a repeat "
             f"decode the same prompt, one after the other); in brackets {interval}."
             if coverage else "- A ratio is one of medians; in brackets the smallest and largest "
             "per-repeat ratio."),
            "- Best fixed: the sweep's fastest of plain decoding, prompt lookup alone and "
            "mlx-spec at a fixed k with the pair's drafter (no lookup), measured again in the "
            "table. mlx-lm at its best k is beside it, not the bar ('-': mlx-lm cannot run "
            "the pair: an MTP head, or caches it cannot trim).",
            "- Acceptance: accepted drafts over drafted ones in the timed rounds.", ""]
    behind = _behind(result)
    caveat = (" (one repeat: no spread, so this cannot tell noise from a loss)"
              if c.repeats < 2 else "")
    out += [f"Below 1.0x with the whole interval{caveat}: " + ("none." if not behind else ""),
            ""]
    out += [f"- {line}" for line in behind] + ([""] if behind else [])
    if result.copy_rows:
        out += ["## Copy task (T = 0): the target's own continuation, then its opening again", ""]
        out += _table(
            ("pair", "prompt tokens", "plain tok/s", "lookup tok/s", "lookup ÷ plain",
             "defaults tok/s (no cal / cal)", "defaults ÷ plain (no cal / cal)",
             "tokens per round (lookup / defaults / +cal)"),
            [[r.pair, str(r.prompt_tokens), _tps(r.methods[PLAIN]), _tps(r.methods[LOOKUP]),
              _x(r.ratios["lookup / plain"]),
              f"{_tps(r.methods[DEFAULTS])} / {_tps(r.methods.get(DEFAULTS_CAL))}",
              f"{_x(r.ratios['defaults / plain'])} / {_x(r.ratios.get('defaults+cal / plain'))}",
              " / ".join(f"{r.tokens_per_round[name]:.2f}" if name in r.tokens_per_round
                         else "n/a" for name in (LOOKUP, DEFAULTS, DEFAULTS_CAL))]
             for r in result.copy_rows])
    if result.copy_rows:
        out += ["Sweep medians (tokens/s) per row: in the JSON file (rows[].sweep).", ""]
    out.append(f"Took {result.elapsed_s:.0f} s; seed {c.seed}; every figure is in the JSON file.")
    return "\n".join(out) + "\n"


QUICK = dict(temps=(0.0, 1.0), ks=(1, 2, 4), lm_ks=(1, 2, 4), repeats=1, sweep_repeats=1,
             max_tokens=48)
HALVES = {"tuned": TUNED_NAMES, "held-out": HELD_OUT_NAMES, "all": ZOO_NAMES}


def _floats(text):
    return tuple(float(v) for v in text.split(",") if v)


def _names(text):
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=lambda t: HALVES.get(t) or _names(t), default=ZOO_NAMES,
                        help=f"comma-separated, from {', '.join(ZOO_NAMES)}; or tuned, "
                             f"held-out, all (default: all)")
    parser.add_argument("--temps", type=_floats, default=DEFAULT_TEMPS,
                        help="comma-separated temperatures (default: 0,0.7,1)")
    parser.add_argument("--ks", type=lambda t: tuple(int(v) for v in t.split(",")),
                        default=None, help="mlx-spec's fixed k to sweep (default: 1,2,3,4,6,8)")
    parser.add_argument("--lm-ks", type=lambda t: tuple(int(v) for v in t.split(",")),
                        default=None, help="mlx-lm's fixed k, beside (default: 1,2,3,4)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=8,
                        help="the table's repeats (default 8: ~93%% intervals for its ratios)")
    parser.add_argument("--sweep-repeats", type=int, default=3,
                        help="repeats of mlx-lm's sweep over k, which only picks k (default 3)")
    parser.add_argument("--prompts", type=_names, default=DEFAULT_PROMPTS,
                        help="names from mlx_spec/bench/prompts.py, one per repeat in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-copy-task", action="store_true")
    parser.add_argument("--no-calibration", action="store_true",
                        help="leave the with-calibration column out")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat, T = 0 and 1, k = 1, 2, 4, 48 tokens")
    parser.add_argument("--out", type=Path, default=None,
                        help="path without suffix (default: bench/results/never-behind-"
                             "<machine>-<blas>)")
    parser.add_argument("--rerender", type=Path, default=None,
                        help="rebuild the Markdown from a saved JSON file and exit")
    return parser.parse_args(argv)


def blas_slug(blas: str) -> str:
    lowered = blas.lower()
    for name in ("openblas", "mkl", "blis", "accelerate", "flexiblas"):
        if name in lowered:
            return name
    return "netlib" if "libblas" in lowered else "blas-unknown"


def default_out(blas: str) -> Path:
    machine = re.sub(r"[^a-z0-9]+", "-", f"{platform.system()}-{platform.machine()}".lower())
    return RESULTS_DIR / f"never-behind-{machine.strip('-')}-{blas_slug(blas)}"


def config_from(args):
    chosen = dict(temps=args.temps, ks=args.ks or DEFAULT_KS, lm_ks=args.lm_ks or DEFAULT_LM_KS,
                  repeats=args.repeats,
                  sweep_repeats=args.sweep_repeats, max_tokens=args.max_tokens)
    if args.quick:
        chosen.update(QUICK)
    return NeverBehindConfig(prompts=args.prompts, seed=args.seed,
                             copy_task=not args.no_copy_task,
                             calibrate=not args.no_calibration, **chosen)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rerender:
        try:
            result = from_dict(NeverBehind, json.loads(args.rerender.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: cannot rerender {args.rerender}: not a never-behind results file this "
                  f"version reads ({type(exc).__name__}: {exc}).", file=sys.stderr)
            return 2
        args.rerender.with_suffix(".md").write_text(render_markdown(result))
        print(args.rerender.with_suffix(".md"))
        return 0
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", file=sys.stderr, flush=True)

    try:
        pairs = build_zoo(args.pairs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress(f"built {', '.join(p.name for p in pairs)}")
    out = args.out or default_out(machine_info().blas)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: NeverBehind) -> None:
        out.with_suffix(".json").write_text(json.dumps(result.as_dict(), indent=1))

    result = measure(pairs, config_from(args), progress, checkpoint=save)
    save(result)
    markdown = render_markdown(result)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    progress(f"wrote {out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
