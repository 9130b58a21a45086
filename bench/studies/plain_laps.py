"""How well does the cold start's trial time a plain step? Its two readings against plain decoding.

    python -m bench.studies.plain_laps --out plain-laps-openblas   # (OpenBLAS preload)

With no calibration the policy decodes a few plain steps (the trial) before
its first verdict, and every verdict compares a source's rounds with the
plain step it timed there. The loop queues a plain block's steps back to back,
so the block's first lap carries the pipeline's fill and its last is short.
For each pair, temperature and repeat (the never-behind prompts in turn) this
records, as the trial ends in a run of the defaults (uncalibrated, `--tokens`),
both readings the policy keeps: the median of the steady laps (those with a
lap before and after them in their block: policy.STEADY_PLAIN_STEPS) and the
mean of every lap (the rule off); then plain decoding of the same prompt (the
tables' plain: mlx-lm's loop, `--tokens` tokens) gives the step they estimate.
`--rule-off` runs the defaults with the rule off, whose trial is shorter (its
readings are then those of the policy before the rule). Writes
bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

from mlx_spec import policy as policy_module
from mlx_spec.generate import speculative_generate_step
from mlx_spec.policy import AdaptivePolicy
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.endtoend import run_target_alone
from mlx_spec.bench.prompts import encode_prompts
from ..zoo import ZOO_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .never_behind import DEFAULT_PROMPTS

DEFAULT_PAIRS = "mtp-f32,skip-f32,hybrid-skip-f32,sliding-f32,hybrid-f32,strong,shipped-f16"


def trial_readings(pair, ids, temp: float, tokens: int) -> dict:
    """The policy's two readings of a plain step as its trial ends, in one run of the defaults."""
    seen = {}
    original = AdaptivePolicy._judge_first_looks

    def record(self):
        n, seconds = self.plain_time
        seen.update(steady=statistics.median(self.steady_laps) if self.steady_laps else None,
                    every_lap=seconds / n if n else None, laps=int(n))
        return original(self)
    AdaptivePolicy._judge_first_looks = record
    try:
        for _ in speculative_generate_step(ids, pair.target_model, pair.draft_model,
                                           max_tokens=tokens, sampling=SamplingConfig(temp=temp),
                                           calibration=None, **pair.draft_options):
            pass
    finally:
        AdaptivePolicy._judge_first_looks = original
    return seen


def _ratio_median(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=DEFAULT_PAIRS)
    parser.add_argument("--temps", default="0.7,1")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rule-off", action="store_true",
                        help="policy.STEADY_PLAIN_STEPS off (the shorter trial before it)")
    parser.add_argument("--out", default="plain-laps")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, ZOO_NAMES)
    if args.repeats < 1 or args.tokens < 16:
        parser.error("--repeats must be >= 1 and --tokens >= 16.")
    shipped = policy_module.STEADY_PLAIN_STEPS
    policy_module.STEADY_PLAIN_STEPS = shipped and not args.rule_off
    try:
        rows = measure(args)
    finally:
        policy_module.STEADY_PLAIN_STEPS = shipped
    header = study_header("plain_laps", argv, tokens=args.tokens, repeats=args.repeats,
                          rule=not args.rule_off)
    write_results(args.out, header, rows, render(header, rows, args))


def measure(args) -> list:
    rows = []
    for pair in build_zoo(args.pairs.split(",")):
        prompts = [ids for p, ids in encode_prompts(pair.tokenizer) if p.name in DEFAULT_PROMPTS]
        for temp in (float(t) for t in args.temps.split(",")):
            trial_readings(pair, prompts[0], temp, 8)  # warm-up
            runs = []
            for repeat in range(args.repeats):
                ids = prompts[repeat % len(prompts)]
                seen = trial_readings(pair, ids, temp, args.tokens)
                plain = run_target_alone(pair.target_model, ids, temp, args.tokens)
                step = plain.seconds / plain.tokens
                runs.append({"plain_step": step, **seen,
                             "steady_over_plain": seen.get("steady") and seen["steady"] / step,
                             "every_lap_over_plain": seen.get("every_lap")
                             and seen["every_lap"] / step})
            rows.append({"pair": pair.name, "temp": temp, "runs": runs})
            print(f"{pair.name}, T={temp:g}: steady/plain "
                  f"{_ratio_median(r['steady_over_plain'] for r in runs)}, every lap/plain "
                  f"{_ratio_median(r['every_lap_over_plain'] for r in runs)}", flush=True)
    return rows


def render(header: dict, rows: list, args) -> str:
    trial = policy_module.trial_steps() if not args.rule_off else policy_module.SHORT_TRIAL_STEPS
    lines = ["# The cold start's trial: its reading of a plain step against plain decoding's", "",
             f"`{header['command']}`  ", f"{header['machine']}; prompts "
             f"{', '.join(DEFAULT_PROMPTS)} in turn, {args.repeats} repeats; each repeat a run of "
             f"the defaults ({args.tokens} tokens, uncalibrated; the readings as its trial ends) "
             f"then plain decoding of the same prompt ({args.tokens} tokens: its seconds per "
             f"token). Medians over the repeats. STEADY_PLAIN_STEPS "
             f"{'off' if args.rule_off else 'on'}: a trial of {trial} steps, the first untimed; "
             f"the policy reads {'every lap' if args.rule_off else 'the steady laps'}.",
             "",
             "| pair | T | plain step ms | steady laps' median ÷ plain step "
             "| every lap's mean ÷ plain step | laps timed in the trial |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        runs = row["runs"]
        laps = sorted({r.get("laps") for r in runs if r.get("laps") is not None})
        lines.append(
            f"| {row['pair']} | {row['temp']:g} | "
            f"{1000 * statistics.median(r['plain_step'] for r in runs):.2f} | "
            f"{_ratio_median(r['steady_over_plain'] for r in runs)} | "
            f"{_ratio_median(r['every_lap_over_plain'] for r in runs)} | "
            f"{', '.join(map(str, laps)) or '-'} |")
    lines += ["", "'-': no trial ended in the run (a source drafted through it, or none was "
              "asked)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
