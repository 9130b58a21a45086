"""Is mlx-spec ever behind plain decoding or mlx-lm's best fixed k? One table over the pair zoo.

Run from the repository root:

    python -m mlx_spec.bench.studies.never_behind            # every pair, T = 0 / 0.7 / 1
    python -m mlx_spec.bench.studies.never_behind --quick    # one repeat, fewer k and T
    python -m mlx_spec.bench.studies.never_behind --pairs weak,strong --temps 0 --repeats 5
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m mlx_spec.bench.studies.never_behind        # the same with OpenBLAS
    python -m mlx_spec.bench.studies.never_behind --rerender bench/results/never-behind-....json

Writes bench/results/never-behind-<machine>-<blas>.json and .md (the BLAS
library MLX actually loaded; --out another path); progress goes to stderr.
The pairs: mlx_spec/bench/zoo.py.

Time on the 2-core development CPU (netlib BLAS, quiet machine): the full
run (4 pairs x 3 T, 8 table repeats, 3 sweep repeats, 64 tokens, copy task)
took 30 minutes; --quick (one repeat) a few minutes.

What is measured, and how: for each pair and temperature T, two interleaved
phases in one process:

1. sweep: mlx-lm's speculative_generate_step at each fixed k; its best k is
   the one with the highest median tokens/s;
2. table: plain decoding (mlx-lm's generate_step, the target alone), mlx-lm
   at that k, mlx-spec at that k with the same kind of policy (fixed k, no
   prompt lookup), and mlx-spec's defaults without and with a calibration.

Every compared figure comes from phase 2: mlx-lm@k is measured again rather
than taken from the sweep, whose best median is the luckiest of several
noisy ones. "Best fixed" is the faster of mlx-lm@k and mlx-spec@k (mlx-spec
at the other k is not measured). A ratio is the median of the per-repeat
ratios (both methods ran on the same prompt in the same repeat), with a
distribution-free confidence interval for it beside it (order statistics,
~93% with 8 repeats), so a reader sees whether 0.97x is noise. The sweep only
picks k, so it runs fewer repeats than the table.

Timing: plain, mlx-lm@k and mlx-spec@k decode from caches prefilled untimed
(endtoend.py). The defaults get the whole prompt, since prompt lookup reads
it, and are timed from the end of their first round, which carries the
prefill (as sources.py). A copy task per pair at T = 0 (the target's own
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

from ...generate import speculative_generate_step
from ...memory import wired_limit
from ...sampling import SamplingConfig
from ..endtoend import (MethodResult, RunResult, interleave, run_mlx_lm, run_mlx_spec,
                        run_target_alone)
from ..machine import MachineInfo, machine_info
from ..prompts import PROMPTS, Prompt, encode_prompts
from ..serialize import from_dict
from ..timing import DEFAULT_WARMUP, median, median_interval, ratio, time_after_prefill
from ..zoo import ZOO_NAMES, Pair, build_zoo
from . import RESULTS_DIR

PLAIN, LM_AT_K, SPEC_AT_K = "plain", "mlx-lm@k", "mlx-spec@k"
DEFAULTS, DEFAULTS_CAL, LOOKUP = "defaults", "defaults+cal", "lookup"
DEFAULT_KS = (1, 2, 3, 4, 5, 6)
DEFAULT_TEMPS = (0.0, 0.7, 1.0)
DEFAULT_PROMPTS = ("class_init", "parse_args", "rename")
COPY_SOURCE_PROMPT, COPY_CONTINUATION_TOKENS = "fibonacci", 96


@dataclass(frozen=True)
class NeverBehindConfig:
    temps: Tuple[float, ...] = DEFAULT_TEMPS
    ks: Tuple[int, ...] = DEFAULT_KS
    max_tokens: int = 64
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


@dataclass(frozen=True)
class Row:
    pair: str
    temp: float
    mlx_lm_by_k: Dict[int, float]  # the sweep's median tokens/s per k
    best_k: int
    best_fixed: str  # LM_AT_K or SPEC_AT_K, whichever is faster
    methods: Dict[str, MethodResult]  # DEFAULTS_CAL absent when no calibration
    ratios: Dict[str, Optional[Ratio]]


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


def row_ratios(methods: Dict[str, MethodResult]) -> Tuple[Dict[str, Optional[Ratio]], str]:
    """The table's ratios, and which fixed-k method is the best fixed one."""
    best_fixed = max((LM_AT_K, SPEC_AT_K), key=lambda name: methods[name].tokens_per_s)
    ratios = {"mlx-spec@k / mlx-lm@k": paired_ratio(methods[SPEC_AT_K], methods[LM_AT_K])}
    for name in (DEFAULTS, DEFAULTS_CAL):
        ratios[f"{name} / plain"] = paired_ratio(methods.get(name), methods[PLAIN])
        ratios[f"{name} / best fixed"] = paired_ratio(methods.get(name), methods[best_fixed])
    return ratios, best_fixed


def calibration_unavailable() -> Optional[str]:
    """Why no calibration can be passed to speculative_generate_step yet, or None."""
    if "calibration" not in inspect.signature(speculative_generate_step).parameters:
        return "speculative_generate_step takes no calibration argument yet"
    try:
        from ..calibrate import calibrate  # noqa: F401
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
        pair.target_model, pair.draft_model, ids, temp, max_tokens, logs.get(name), **options))
        for name, options in variants.items()}


def _labelled(progress, label: str):
    return (lambda message: progress(f"{label}: {message}")) if progress else None


def measure_row(pair: Pair, prompts, temp: float, config: NeverBehindConfig, calibration,
                takes_calibration: bool, progress=None) -> Row:
    """Phase 1 (mlx-lm's sweep over k), then phase 2 (the table's methods) for one pair and T."""
    target_model, draft_model, n = pair.target_model, pair.draft_model, config.max_tokens
    timing = dict(repeats=config.repeats, warmup=config.warmup, seed=config.seed)
    label = f"{pair.name}, T={temp:g}"
    sweep = {k: (lambda ids, k=k: run_mlx_lm(target_model, draft_model, ids, temp, k, n))
             for k in config.ks}
    swept = interleave(sweep, prompts, progress=_labelled(progress, f"{label}, mlx-lm sweep"),
                       **{**timing, "repeats": config.sweep_repeats})
    best_k = max(config.ks, key=lambda k: swept[k].tokens_per_s)
    methods = {
        PLAIN: lambda ids: run_target_alone(target_model, ids, temp, n),
        LM_AT_K: lambda ids: run_mlx_lm(target_model, draft_model, ids, temp, best_k, n),
        SPEC_AT_K: lambda ids: run_mlx_spec(target_model, draft_model, ids, temp, best_k, n),
        **_defaults_methods(pair, temp, n, calibration, takes_calibration),
    }
    results = interleave(methods, prompts, progress=_labelled(progress, f"{label}, k={best_k}"),
                         **timing)
    ratios, best_fixed = row_ratios(results)
    return Row(pair.name, temp, {k: r.tokens_per_s for k, r in swept.items()}, best_k,
               best_fixed, results, ratios)


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
            progress: Optional[Callable[[str], None]] = None) -> NeverBehind:
    """Every row of the table (and the copy task) for every pair, in one process."""
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
        calibration = None
        if missing is None:
            say(f"{pair.name}: calibrating")
            began = time.perf_counter()
            from ..calibrate import calibrate
            calibration = calibrate(pair.target_model, pair.draft_model, pair.tokenizer)
            calibration_s[pair.name] = time.perf_counter() - began
        with wired_limit(pair.target_model, pair.draft_model):
            for temp in config.temps:
                rows.append(measure_row(pair, prompts, temp, config, calibration,
                                        takes_calibration, progress))
            if config.copy_task:
                copy_rows.append(measure_copy(pair, config, calibration, takes_calibration,
                                              progress))
    return NeverBehind(config, machine_info(), {p.name: p.note for p in pairs},
                       missing or "used", calibration_s, rows, copy_rows,
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


def render_markdown(result: NeverBehind) -> str:
    m, c = result.machine, result.config
    out = ["# Never behind: mlx-spec against plain decoding and mlx-lm's best fixed k", "",
           f"- Machine: {m.chip}, {m.cpu_count} cores, MLX device {m.mlx_device}, BLAS {m.blas}, "
           f"MLX {m.mlx_version}, mlx-lm {m.mlx_lm_version}.",
           f"- {c.max_tokens} tokens per run, median of {c.repeats} interleaved repeats after "
           f"{c.warmup} warm-up (the order reversed every other repeat), prompts "
           f"{', '.join(c.prompts)} (one per repeat, in turn); mlx-lm's k swept over "
           f"{', '.join(map(str, c.ks))} ({c.sweep_repeats} repeats).",
           f"- Calibration: {result.calibration}"
           + "".join(f"; {name} {s:.1f} s" for name, s in result.calibration_s.items()) + ".",
           ""]
    out += _table(("pair", "what"), [[name, note] for name, note in result.pairs.items()])
    rows = []
    for row in result.rows:
        ms, rs = row.methods, row.ratios
        rows.append([row.pair, f"{row.temp:g}", _tps(ms[PLAIN]), str(row.best_k),
                     _tps(ms[LM_AT_K]), _tps(ms[SPEC_AT_K]), _x(rs["mlx-spec@k / mlx-lm@k"]),
                     f"{_tps(ms[DEFAULTS])} / {_tps(ms.get(DEFAULTS_CAL))}",
                     f"{_x(rs['defaults / plain'])} / {_x(rs['defaults+cal / plain'])}",
                     f"{_x(rs['defaults / best fixed'])} / {_x(rs['defaults+cal / best fixed'])}",
                     " / ".join(_pct(ms.get(name)) for name in
                                (LM_AT_K, SPEC_AT_K, DEFAULTS, DEFAULTS_CAL))])
    out += _table(("pair", "T", "plain tok/s", "mlx-lm best k", "mlx-lm@k tok/s",
                   "mlx-spec@k tok/s", "mlx-spec@k ÷ mlx-lm@k",
                   "defaults tok/s (no cal / cal)", "defaults ÷ plain (no cal / cal)",
                   "defaults ÷ best fixed (no cal / cal)",
                   "acceptance (mlx-lm@k / mlx-spec@k / defaults / +cal)"), rows)
    coverage = max((r.coverage for row in result.rows for r in row.ratios.values() if r),
                   default=0.0)
    interval = (f"a {coverage:.0%} confidence interval for that median (order statistics, "
                "no assumption on the distribution)")
    out += [(f"- A ratio is the median of the per-repeat ratios (paired: both runs of a repeat "
             f"decode the same prompt, one after the other); in brackets {interval}."
             if coverage else "- A ratio is one of medians; in brackets the smallest and largest "
             "per-repeat ratio."),
            "- Best fixed: the faster of mlx-lm@k and mlx-spec@k at mlx-lm's best k.",
            "- mlx-lm's acceptance counts its from_draft tokens (token matching at T > 0).", ""]
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
    out.append(f"Took {result.elapsed_s:.0f} s; seed {c.seed}; every figure is in the JSON file.")
    return "\n".join(out) + "\n"


QUICK = dict(temps=(0.0, 1.0), ks=(1, 2, 4), repeats=1, sweep_repeats=1, max_tokens=48)


def _floats(text):
    return tuple(float(v) for v in text.split(",") if v)


def _names(text):
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=_names, default=ZOO_NAMES,
                        help=f"comma-separated, from {', '.join(ZOO_NAMES)} (default: all)")
    parser.add_argument("--temps", type=_floats, default=DEFAULT_TEMPS,
                        help="comma-separated temperatures (default: 0,0.7,1)")
    parser.add_argument("--ks", type=lambda t: tuple(int(v) for v in t.split(",")),
                        default=None, help="mlx-lm's fixed k to sweep (default: 1..6)")
    parser.add_argument("--max-tokens", type=int, default=64)
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
    chosen = dict(temps=args.temps, ks=args.ks or DEFAULT_KS, repeats=args.repeats,
                  sweep_repeats=args.sweep_repeats, max_tokens=args.max_tokens)
    if args.quick:
        chosen.update(QUICK)
    return NeverBehindConfig(prompts=args.prompts, seed=args.seed,
                             copy_task=not args.no_copy_task,
                             calibrate=not args.no_calibration, **chosen)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rerender:
        result = from_dict(NeverBehind, json.loads(args.rerender.read_text()))
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
    result = measure(pairs, config_from(args), progress)
    out = args.out or default_out(result.machine.blas)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result.as_dict(), indent=1))
    markdown = render_markdown(result)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    progress(f"wrote {out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
