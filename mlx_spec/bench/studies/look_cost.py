"""What the prompt look costs before the first token, and what it buys over a whole reply.

    python -m mlx_spec.bench.studies.look_cost --out look-cost-netlib
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m mlx_spec.bench.studies.look_cost --out look-cost-openblas

The never-behind and long-replies tables time a reply from its first token on,
so they never see the look (mlx_spec/prompt_look.py): it runs after the
prefill, before the first token (the target's and each drafter's output layer
over the prompt's last rows, and the last layer's rows it needs). Here each
call of the defaults (uncalibrated, prompt lookup as the defaults set it) is
timed from the call: the time to its first token and to the whole reply of
`--tokens`, with the look on and off (greedy: policy.GREEDY_LOOK; at T > 0:
policy.PROMPT_LOOK, which there also sets the prior), interleaved per prompt,
the order reversed every other repeat. Reported: the look's median cost to the
first token (paired differences), in milliseconds and in the pair's plain
steps (a plain step: the median of plain decoding's steps on the same
prompts), and the whole reply's time without the look over with it (above 1:
the look pays for itself). Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List

import mlx.core as mx

from ... import policy as policy_module
from ...generate import speculative_generate_step
from ...sampling import SamplingConfig
from ..endtoend import run_target_alone
from ..prompts import PROMPTS, encode_prompts
from ..timing import median_interval
from ..zoo import PAIR_NAMES, TUNED_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .never_behind import DEFAULT_PROMPTS


def flag_for(temp: float) -> str:
    """The rule that turns the look on or off at `temp`."""
    return "GREEDY_LOOK" if temp == 0 else "PROMPT_LOOK"


def timed_call(pair, ids, temp: float, tokens: int, look: bool) -> tuple:
    """(seconds to the first token, seconds to the whole reply) of one call of the defaults."""
    flag = flag_for(temp)
    saved = getattr(policy_module, flag)
    setattr(policy_module, flag, look)
    try:
        start = time.perf_counter()
        first = None
        for _ in speculative_generate_step(ids, pair.target_model, pair.draft_model,
                                           max_tokens=tokens, sampling=SamplingConfig(temp=temp),
                                           calibration=None, **pair.draft_options):
            if first is None:
                first = time.perf_counter() - start
        return first, time.perf_counter() - start
    finally:
        setattr(policy_module, flag, saved)


def measure(pair_names: List[str], temps: List[float], tokens: int, repeats: int) -> List[dict]:
    by_name = {p.name: p for p in PROMPTS}
    rows = []
    for pair in build_zoo(pair_names):
        prompts = [ids for _, ids in encode_prompts(pair.tokenizer,
                                                    [by_name[n] for n in DEFAULT_PROMPTS])]
        for temp in temps:
            print(f"{pair.name}, T={temp:g} ...", file=sys.stderr, flush=True)
            costs, gains, plain_steps = [], [], []
            for r in range(1 + repeats):
                ids = prompts[r % len(prompts)]
                mx.random.seed(r)
                plain = run_target_alone(pair.target_model, ids, temp, 16)
                order = (True, False) if r % 2 == 0 else (False, True)
                timed = {}
                for look in order:
                    mx.random.seed(r)
                    timed[look] = timed_call(pair, ids, temp, tokens, look)
                if r == 0:
                    continue  # the warm-up
                plain_steps.append(plain.seconds / max(plain.tokens, 1))
                costs.append(timed[True][0] - timed[False][0])
                gains.append(timed[False][1] / timed[True][1])
            step = statistics.median(plain_steps)
            cost_low, cost_high, _ = median_interval(costs)
            gain_low, gain_high, _ = median_interval(gains)
            row = {"pair": pair.name, "temp": temp, "plain_step_ms": step * 1e3,
                   "look_ms": [statistics.median(costs) * 1e3, cost_low * 1e3, cost_high * 1e3],
                   "look_steps": statistics.median(costs) / step,
                   "reply_off_over_on": [statistics.median(gains), gain_low, gain_high]}
            rows.append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def render(rows: List[dict], header: dict) -> str:
    out = ["# The prompt look: its cost before the first token, and the whole reply with it", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; the defaults uncalibrated, {header['tokens']} tokens, timed from "
           f"the call; median of {header['repeats']} paired repeats after a warm-up (prompts "
           f"{', '.join(DEFAULT_PROMPTS)} in turn). The look at T = 0 is policy.GREEDY_LOOK, at "
           "T > 0 policy.PROMPT_LOOK (there it also sets the prior).", "",
           "| pair | T | plain step ms | the look, ms before the first token | in plain steps | "
           "whole reply: without ÷ with the look's time |",
           "|---|---|---|---|---|---|"]
    for row in rows:
        ms, low, high = row["look_ms"]
        gain, glow, ghigh = row["reply_off_over_on"]
        out.append(f"| {row['pair']} | {row['temp']:g} | {row['plain_step_ms']:.1f} | "
                   f"{ms:.1f} ({low:.1f} to {high:.1f}) | {row['look_steps']:.1f} | "
                   f"{gain:.2f}x ({glow:.2f}-{ghigh:.2f}) |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(TUNED_NAMES))
    parser.add_argument("--temps", default="0,0.7")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="look-cost")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, PAIR_NAMES)
    try:
        temps = [float(t) for t in args.temps.split(",")]
    except ValueError:
        parser.error(f"--temps takes numbers separated by commas, got {args.temps!r}.")
    if min(temps) < 0 or args.tokens < 1 or args.repeats < 1:
        parser.error("--temps must be >= 0, --tokens and --repeats >= 1.")
    rows = measure(args.pairs.split(","), temps, args.tokens, args.repeats)
    header = study_header("look_cost", argv, tokens=args.tokens, repeats=args.repeats)
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
