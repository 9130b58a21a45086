"""A draft model's step against the target's first plain step: what the cold start compares.

    python -m bench.studies.draft_step --out draft-step-netlib
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m bench.studies.draft_step --out draft-step-openblas

With no calibration the loop times one step of a draft model right after its
prompt prefill and the target's first plain step; a draft whose step takes as
long as that step divided by FIRST_STEP_SLOWER is off before its first look, and
one whose step takes as long as a steady plain step of the trial is off after it
(mlx_spec/policy.py, COSTLY_DRAFT_OFF). For
every pair of the zoo with a draft model, this runs the defaults for a few
tokens and reads both times from the policy itself, with the steady plain
step of the cold start's trial beside them; medians over the prompts in turn
after a warm-up, and in how many cold starts the draft drafted no round (off
before its first look). Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import List

from mlx_spec.generate import speculative_generate_step
from mlx_spec.policy import FIRST_STEP_DISCOUNTED, FIRST_STEP_SLOWER, AdaptivePolicy
from mlx_spec.bench.prompts import PROMPTS, encode_prompts
from ..zoo import ZOO_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .never_behind import DEFAULT_PROMPTS


def timed_steps(pair, ids) -> tuple:
    """(draft step, target's first plain step, its median steady plain step) in seconds, and
    whether the draft was off before its first look (it drafted no round in 8 tokens)."""
    policy = AdaptivePolicy()
    for _ in speculative_generate_step(ids, pair.target_model, pair.draft_model, max_tokens=8,
                                       policy=policy, prompt_lookup=False,
                                       **pair.draft_options):
        pass
    return (policy.draft_step_seconds["draft"], policy.first_step_seconds,
            policy.measured_plain_seconds, policy.source("draft").rounds == 0)


def decision(draft: float, first: float, steady: float) -> str:
    """What the cold start does with such a draft, at the medians (policy.AdaptivePolicy._costly:
    the first step divided by FIRST_STEP_SLOWER with FIRST_STEP_DISCOUNTED)."""
    if draft >= first / (FIRST_STEP_SLOWER if FIRST_STEP_DISCOUNTED else 1.0):
        return "off before its first look"
    if draft >= steady:
        return "off after its first look"
    return "judged by its rounds"


def measure(pair_names: List[str], repeats: int) -> List[dict]:
    by_name = {p.name: p for p in PROMPTS}
    rows = []
    for pair in build_zoo(pair_names):
        if isinstance(pair.draft_model, str):  # an MTP head follows the target: no prefill
            continue
        prompts = encode_prompts(pair.tokenizer, [by_name[n] for n in DEFAULT_PROMPTS])
        timed_steps(pair, prompts[0][1])  # warm-up
        runs = [timed_steps(pair, prompts[r % len(prompts)][1]) for r in range(repeats)]
        draft, first, steady = (statistics.median(run[i] for run in runs) for i in range(3))
        rows.append({"pair": pair.name, "draft_step_s": draft, "first_step_s": first,
                     "plain_step_s": steady, "draft_over_first": draft / first,
                     "draft_over_plain": draft / steady, "decision": decision(draft, first, steady),
                     "off_before_look": sum(run[3] for run in runs), "cold_starts": len(runs)})
        print(f"{rows[-1]}", file=sys.stderr, flush=True)
    return rows


def render(rows: List[dict], header: dict) -> str:
    out = ["# A draft model's step against the target's first plain step", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; medians of {header['repeats']} cold starts (prompts "
           f"{', '.join(DEFAULT_PROMPTS)} in turn) after a warm-up, read from the policy.", "",
           "| pair | draft step | target's first step | steady plain step | draft ÷ first | "
           "draft ÷ steady | cold start (medians) | off before its first look |",
           "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        out.append(f"| {row['pair']} | {row['draft_step_s'] * 1e3:.2f} ms | "
                   f"{row['first_step_s'] * 1e3:.2f} ms | {row['plain_step_s'] * 1e3:.2f} ms | "
                   f"{row['draft_over_first']:.2f} | {row['draft_over_plain']:.2f} | "
                   f"{row['decision']} | "
                   + (f"{row['off_before_look']} of {row['cold_starts']} |"
                      if "off_before_look" in row else "- |"))  # (files before December 5)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(ZOO_NAMES))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default="draft-step")
    args = parser.parse_args(argv)
    pairs = args.pairs.split(",")
    check_pairs(parser, args.pairs, ZOO_NAMES)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1.")
    rows = measure(pairs, args.repeats)
    header = study_header("draft_step", argv, repeats=args.repeats)
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
