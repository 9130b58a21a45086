"""Does the prompt look keep to its budget on this machine? Its time against what the policy predicted.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m bench.studies.look_budget --pairs skip-f32,mtp-f32 --out NAME

policy.LOOK_BUDGET lets the look (mlx_spec/prompt_look.py) cost LOOK_SHARE of
the reply's plain time. It decides the rows before any steady plain step is
timed: a plain step is the target's first step divided by FIRST_STEP_SLOWER,
and the look's cost is LOOK_FIXED_TOKENS plus LOOK_ROW_TOKENS a row of the
target's prefill time per prompt token. Here each call of the defaults
(uncalibrated, `--tokens`, T > 0) records the rows the budget bought, the look's
own time (loop._take_look), and the two estimates; plain decoding of the same
prompt, as long and timed right before, gives the steady step. Reported per pair and T,
medians over the calls: the step estimate over the steady step, the rows, the
look in milliseconds and in steady steps, the look over its budget at the
steady step (above 1: it cost more than LOOK_SHARE of the reply), and the look
over the cost the policy predicted for the rows it bought (a short prompt may
hold fewer: the prediction is then high, the ratio low). Calls where the look compared
no rows (too few bought, or the draft off before it: COSTLY_DRAFT_OFF) are
counted, not timed.
Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from statistics import median
from typing import List

import mlx.core as mx

from mlx_spec import loop as loop_module
from mlx_spec import policy as policy_module
from mlx_spec.policy import AdaptivePolicy
from mlx_spec.bench.endtoend import run_target_alone
from ..zoo import HELD_OUT_NAMES, PAIR_NAMES, build_zoo
from . import check_pairs, constants, parse_temps, study_header, write_results
from .look_cost import prompts_of, timed_call


def one_call(pair, ids, temp: float, tokens: int) -> dict:
    """One call of the defaults: the look's rows, time and the policy's estimates then."""
    seen = {}
    take_look, look_rows = loop_module._take_look, AdaptivePolicy.look_rows
    observe = AdaptivePolicy.observe_prompt_look

    def timed_look(policy, looks, sampling, most, per_token, max_tokens):
        start = time.perf_counter()
        take_look(policy, looks, sampling, most, per_token, max_tokens)
        seen["look_s"] = time.perf_counter() - start

    def bought(self, seconds_per_token, tokens_, most):
        rows = look_rows(self, seconds_per_token, tokens_, most)
        seen.update(rows=rows, per_token_s=seconds_per_token,
                    step_estimate_s=self.steady_step_seconds())
        return rows

    def compared(self, source, acceptance, count, **options):
        seen["compared"] = seen.get("compared", 0) + count
        return observe(self, source, acceptance, count, **options)
    with constants(loop_module, _take_look=timed_look), \
            constants(AdaptivePolicy, look_rows=bought, observe_prompt_look=compared):
        timed_call(pair, ids, temp, tokens, True)
    return seen


def summary(pair_name: str, temp: float, calls: List[dict], tokens: int) -> dict:
    """The medians over the calls whose look compared rows (not: too few bought, or every
    source it would look at already off)."""
    looked = [c for c in calls if c.get("look_s") is not None and c.get("compared", 0) > 0]
    row = {"pair": pair_name, "temp": temp, "calls": len(calls), "looked": len(looked)}
    if not looked:
        return row
    share = policy_module.LOOK_SHARE
    predicted = [(policy_module.LOOK_FIXED_TOKENS + policy_module.LOOK_ROW_TOKENS * c["rows"])
                 * c["per_token_s"] for c in looked]
    row.update(
        steady_step_ms=median(c["steady_s"] for c in looked) * 1e3,
        estimate_over_steady=median(c["step_estimate_s"] / c["steady_s"] for c in looked),
        rows=median(c["rows"] for c in looked),
        look_ms=median(c["look_s"] for c in looked) * 1e3,
        look_steps=median(c["look_s"] / c["steady_s"] for c in looked),
        over_budget=median(c["look_s"] / (share * tokens * c["steady_s"]) for c in looked),
        over_predicted=median(c["look_s"] / p for c, p in zip(looked, predicted)))
    return row


def measure(pair_names: List[str], temps: List[float], tokens: int, repeats: int) -> List[dict]:
    rows = []
    for pair in build_zoo(pair_names):
        (_, prompts), = prompts_of(pair, [])
        for temp in temps:
            calls = []
            for r in range(1 + repeats):
                ids = prompts[r % len(prompts)]
                mx.random.seed(r)
                plain = run_target_alone(pair.target_model, ids, temp, tokens)
                mx.random.seed(r)
                call = one_call(pair, ids, temp, tokens)
                if r:  # (the first: a warm-up)
                    calls.append({**call, "steady_s": plain.seconds / max(plain.tokens, 1)})
            rows.append(summary(pair.name, temp, calls, tokens))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def render(rows: List[dict], header: dict) -> str:
    out = ["# Does the prompt look keep to its budget?", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; the defaults uncalibrated, {header['tokens']} tokens, "
           f"{header['repeats']} calls after a warm-up (prompts in turn), each after plain "
           "decoding of its prompt (the steady step); medians over the calls that took a look. "
           f"The budget: LOOK_SHARE = {policy_module.LOOK_SHARE:g} of the reply's plain time; the "
           f"prediction: LOOK_FIXED_TOKENS = {policy_module.LOOK_FIXED_TOKENS:g} plus "
           f"LOOK_ROW_TOKENS = {policy_module.LOOK_ROW_TOKENS:g} a row, in prompt tokens of "
           "prefill; the step estimate: the target's first step over FIRST_STEP_SLOWER = "
           f"{policy_module.FIRST_STEP_SLOWER:g}.", "",
           "| pair | T | calls that looked | steady step ms | step estimate ÷ steady | rows | "
           "look ms | look in steady steps | look ÷ its budget | look ÷ predicted |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        head = f"| {row['pair']} | {row['temp']:g} | {row['looked']} of {row['calls']} |"
        if not row["looked"]:
            out.append(head + " - | - | - | - | - | - | - |")
            continue
        out.append(head + f" {row['steady_step_ms']:.2f} | {row['estimate_over_steady']:.2f} | "
                   f"{row['rows']:g} | {row['look_ms']:.1f} | {row['look_steps']:.2f} | "
                   f"{row['over_budget']:.2f} | {row['over_predicted']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(HELD_OUT_NAMES))
    parser.add_argument("--temps", default="0.7,1")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="look-budget")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, PAIR_NAMES)
    temps = parse_temps(parser, args.temps)
    if args.tokens < 2 or args.repeats < 1:
        parser.error("--tokens must be >= 2 (the look comes after the first) and --repeats >= 1.")
    if 0 in temps:
        parser.error("--temps must be > 0: greedy, the look is policy.GREEDY_LOOK's (off).")
    header = study_header("look_budget", argv, tokens=args.tokens, repeats=args.repeats)
    rows = measure(args.pairs.split(","), temps, args.tokens, args.repeats)
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
