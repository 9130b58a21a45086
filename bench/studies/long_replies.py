"""Long replies: the defaults against plain decoding over hundreds of tokens, probes included.

    python -m bench.studies.long_replies --out long-replies-netlib
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m bench.studies.long_replies --out long-replies-openblas
    python -m bench.studies.long_replies --flip FIRST_ROUNDS_OPTIMISTIC --tokens 96 \\
        --pairs mtp-f32,strong --temps 0.7,1 --out NAME      # any other rule of the policy
    python -m bench.studies.long_replies --copy --flip WAIT_FOR_MATCH --tokens 96 \\
        --temps 0 --out NAME      # on the never-behind table's copy task, lookup alone beside
    python -m bench.studies.long_replies --no-lookup --flip GREEDY_LOOK --tokens 96 \\
        --pairs weak --temps 0 --out NAME      # a draft alone, no prompt lookup in front

The never-behind table (never_behind.py) decodes 96 tokens: a source switched
off for its long off period (128 tokens) is never probed again inside it. Over
a longer reply the probes come, and a draft model's probe first catches up on
every token decoded meanwhile. This study times, interleaved per prompt,
plain decoding, the defaults, and the defaults with one of the policy's
on/off rules flipped (`--flip NAME`, a boolean constant of mlx_spec/policy.py,
or several separated by commas, flipped together; by default CATCH_UP_IN_BUDGET:
the probe rule before the catch-up was counted in the probe budget), on the zoo's held-out pairs unless `--pairs` names
others, uncalibrated (`--copy`: on the never-behind table's copy task instead
of the three prompts, with prompt lookup alone beside them); ratios are
medians of per-repeat ratios with an order-statistics interval
(never_behind.paired_ratio). Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from typing import List

from mlx_spec import policy as policy_module
from mlx_spec.bench.endtoend import interleave, run_target_alone
from mlx_spec.bench.prompts import PROMPTS, encode_prompts
from ..zoo import HELD_OUT_NAMES, PAIR_NAMES, build_zoo
from . import check_pairs, constants, parse_temps, study_header, write_results
from .never_behind import (COPY_SOURCE_PROMPT, DEFAULT_PROMPTS, copy_prompt, paired_ratio,
                           run_defaults)

PLAIN, DEFAULTS, LOOKUP = "plain", "defaults", "lookup alone"
DEFAULT_FLIP = "CATCH_UP_IN_BUDGET"


def flippable_rules() -> List[str]:
    """The policy's on/off rules: its boolean constants."""
    return sorted(name for name, value in vars(policy_module).items()
                  if name.isupper() and isinstance(value, bool))


def flipped_label(flag: str) -> str:
    """The column of the defaults with `flag` (one rule, or several separated by commas)
    flipped, as the policy now sets it."""
    return "defaults, " + ", ".join(f"{name} = {not getattr(policy_module, name)}"
                                    for name in flag.split(","))


def _with_flag(flag: str, flipped: bool, run):
    """`run` with each rule of `flag` flipped (`flipped`) or as shipped while it runs."""
    def wrapped(ids):
        with constants(policy_module, **{name: getattr(policy_module, name) != flipped
                                         for name in flag.split(",")}):
            return run(ids)
    return wrapped


def measure(pair_names: List[str], temps: List[float], tokens: int, repeats: int,
            flag: str = DEFAULT_FLIP, copy: bool = False, lookup: bool = True) -> List[dict]:
    flipped = flipped_label(flag)
    by_name = {p.name: p for p in PROMPTS}
    rows = []
    for pair in build_zoo(pair_names):
        if copy:
            prompts = [(COPY_SOURCE_PROMPT, copy_prompt(pair, by_name[COPY_SOURCE_PROMPT]))]
        else:
            prompts = encode_prompts(pair.tokenizer, [by_name[n] for n in DEFAULT_PROMPTS])
        for temp in temps:
            def defaults(ids, pair=pair, temp=temp):
                options = {} if lookup else {"prompt_lookup": False}
                return run_defaults(pair.target_model, pair.draft_model, ids, temp, tokens,
                                    calibration=None, **options, **pair.draft_options)
            methods = {
                PLAIN: lambda ids, pair=pair, temp=temp: run_target_alone(
                    pair.target_model, ids, temp, tokens),
                DEFAULTS: _with_flag(flag, False, defaults),
                flipped: _with_flag(flag, True, defaults),
            }
            if copy:
                methods[LOOKUP] = lambda ids, pair=pair, temp=temp: run_defaults(
                    pair.target_model, None, ids, temp, tokens, calibration=None,
                    prompt_lookup=True)
            print(f"{pair.name}, T={temp:g} ...", file=sys.stderr, flush=True)
            results = interleave(methods, prompts, repeats=repeats)
            row = {"pair": pair.name, "temp": temp,
                   "tokens_per_s": {n: r.tokens_per_s for n, r in results.items()}}
            for name in (DEFAULTS, flipped) + ((LOOKUP,) if copy else ()):
                r = paired_ratio(results[name], results[PLAIN])
                row[f"{name} / plain"] = [r.value, r.low, r.high]
            r = paired_ratio(results[DEFAULTS], results[flipped])  # the flip's own effect
            row[f"{DEFAULTS} / flipped"] = [r.value, r.low, r.high]
            rows.append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def render(rows: List[dict], header: dict) -> str:
    flipped = header["flipped"]
    copy = header.get("copy", False)
    columns = [DEFAULTS, flipped] + ([LOOKUP] if copy else [])
    prompts = ("the never-behind table's copy task (the target's own continuation of "
               f"{COPY_SOURCE_PROMPT}, then its opening again)" if copy
               else f"prompts {', '.join(DEFAULT_PROMPTS)} in turn")
    out = [f"# The defaults against plain decoding over {header['tokens']} tokens, and with "
           f"{header['flip']} flipped", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; {header['tokens']} tokens per run, uncalibrated, "
           f"median of {header['repeats']} interleaved repeats after a warm-up ({prompts}); "
           "pairs of the zoo"
           + ("" if header.get("lookup", True) else "; no prompt lookup in front") + ".", "",
           "| pair | T | plain tok/s | " + " | ".join(f"{c} ÷ plain" for c in columns)
           + f" | {DEFAULTS} ÷ {flipped} |",
           "|---|---|---|" + "---|" * (len(columns) + 1)]
    for row in rows:
        cells = [f"{v:.2f}x ({lo:.2f}-{hi:.2f})" for v, lo, hi in
                 [row[f"{c} / plain"] for c in columns] + [row[f"{DEFAULTS} / flipped"]]]
        out.append(f"| {row['pair']} | {row['temp']:g} | {row['tokens_per_s'][PLAIN]:.1f} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(HELD_OUT_NAMES))
    parser.add_argument("--temps", default="0,1")
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="long-replies")
    parser.add_argument("--flip", default=DEFAULT_FLIP,
                        help="a boolean constant of mlx_spec/policy.py to compare flipped "
                             "(several, separated by commas: flipped together)")
    parser.add_argument("--copy", action="store_true",
                        help="the copy task (prompt lookup alone beside it) instead of the prompts")
    parser.add_argument("--no-lookup", action="store_true",
                        help="the defaults without prompt lookup in front (a draft on its own)")
    args = parser.parse_args(argv)
    if args.copy and args.no_lookup:
        parser.error("--copy compares prompt lookup: it cannot run with --no-lookup.")
    unknown_rules = [name for name in args.flip.split(",") if name not in flippable_rules()]
    if unknown_rules:
        parser.error(f"--flip takes the policy's on/off rules ({', '.join(flippable_rules())}), "
                     f"not {unknown_rules[0]!r}.")
    pairs = args.pairs.split(",")
    check_pairs(parser, args.pairs, PAIR_NAMES)
    temps = parse_temps(parser, args.temps)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be >= 1.")
    rows = measure(pairs, temps, args.tokens, args.repeats, args.flip, args.copy,
                   not args.no_lookup)
    header = study_header("long_replies", argv, tokens=args.tokens, repeats=args.repeats,
                          flip=args.flip, flipped=flipped_label(args.flip), copy=args.copy,
                          lookup=not args.no_lookup)
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
