"""Where does one of the policy's rules fire? Counts the runs in which it switched a source off.

    python -m bench.studies.rule_fires --pairs skip-f32,strong --temps 0.7,1 \\
        --out cannot-win-fires-netlib
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m bench.studies.rule_fires --out cannot-win-fires-openblas

A paired timing study (long_replies --flip) says whether a rule moves the
speed; its noise is several percent on 96 tokens. This one says whether the
rule acted at all: it wraps a predicate of AdaptivePolicy (`--predicate`, by
default `_cannot_win`, policy.CANNOT_WIN_OFF) and records, per run of the
defaults (uncalibrated, 96 tokens, the never-behind prompts, `--repeats` each),
every time it returned True: the source's rounds so far, its acceptance
estimate and its k = 1 round's time in plain steps. A row where it never fires
decodes with the rule as without it, so any difference a timing study shows
there is noise. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse

from mlx_spec import policy as policy_module
from mlx_spec.bench.prompts import encode_prompts
from ..zoo import ZOO_NAMES, build_zoo
from . import study_header, write_results
from .never_behind import DEFAULT_PROMPTS, run_defaults


def watched(predicate: str, log: list):
    """Wrap AdaptivePolicy.<predicate>(estimate) so that each True lands in `log`."""
    original = getattr(policy_module.AdaptivePolicy, predicate)

    def wrapper(self, estimate):
        result = original(self, estimate)
        if result:
            t1, plain = estimate.seconds(1), self.plain_seconds
            log.append({"rounds": estimate.rounds, "acceptance": round(estimate.acceptance, 3),
                        "k1_round_in_plain_steps": round(t1 / plain, 2) if t1 and plain else None})
        return result
    setattr(policy_module.AdaptivePolicy, predicate, wrapper)
    return lambda: setattr(policy_module.AdaptivePolicy, predicate, original)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(ZOO_NAMES))
    parser.add_argument("--temps", default="0.7,1")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--predicate", default="_cannot_win")
    parser.add_argument("--out", default="rule-fires")
    args = parser.parse_args(argv)
    if not callable(getattr(policy_module.AdaptivePolicy, args.predicate, None)):
        parser.error(f"--predicate {args.predicate!r} is not a method of AdaptivePolicy.")
    log: list = []
    restore = watched(args.predicate, log)
    rows = []
    try:
        for pair in build_zoo(args.pairs.split(",")):
            prompts = [ids for p, ids in encode_prompts(pair.tokenizer) if p.name in DEFAULT_PROMPTS]
            for temp in (float(t) for t in args.temps.split(",")):
                runs = []
                for _ in range(args.repeats):
                    for ids in prompts:
                        log.clear()
                        run_defaults(pair.target_model, pair.draft_model, ids, temp, args.tokens,
                                     **pair.draft_options)
                        runs.append(list(log))
                fired = [r for r in runs if r]
                rows.append({"pair": pair.name, "temp": temp, "runs": len(runs),
                             "fired_in": len(fired), "firings": fired})
                print(f"{pair.name}, T={temp:g}: fired in {len(fired)} of {len(runs)} runs",
                      flush=True)
    finally:
        restore()
    header = study_header("rule_fires", argv, predicate=args.predicate, tokens=args.tokens,
                          repeats=args.repeats)
    lines = [f"# Where {args.predicate} fires: runs of the defaults in which it returned True", "",
             f"`{header['command']}`  ", f"{header['machine']}; {args.tokens} tokens per run, "
             f"uncalibrated, {args.repeats} repeats of the prompts {', '.join(DEFAULT_PROMPTS)}.",
             "", "| pair | T | fired in | first firing per run (rounds, acceptance, k = 1 round "
             "in plain steps) |", "|---|---|---|---|"]
    for row in rows:
        at = "; ".join(f"{f['rounds']}, {f['acceptance']}, {f['k1_round_in_plain_steps']}"
                       for run in row["firings"] for f in run[:1])
        lines.append(f"| {row['pair']} | {row['temp']:g} | {row['fired_in']} of {row['runs']} "
                     f"| {at or '-'} |")
    write_results(args.out, header, rows, "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
