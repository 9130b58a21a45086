"""How well does the prompt look predict a source's acceptance? Its reading against the rounds'.

    python -m bench.studies.prompt_look --out prompt-look-accuracy

For each zoo pair and temperature, on the never-behind prompts: what the
prompt look measured (mlx_spec/prompt_look.py: the mean chance the rule keeps
a draft at the prompt's last positions, recorded as the loop hands it to the
policy; at T = 0 the share of positions whose argmaxes agree, policy.GREEDY_LOOK,
which the study turns on; files written before it read T = 0 at T = 1e-4, where
sum_x min(p, q) is that agreement), and the per-draft acceptance the policy would then learn from the
reply's rounds: the i.i.d. estimate from each round's chances (T > 0) or its
kept count and rejection (T = 0), over a reply of `--tokens` at a fixed k
(`--k`, no prompt lookup). Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

from mlx_spec import policy as policy_module
from mlx_spec.generate import speculative_generate_step
from mlx_spec.policy import AdaptivePolicy, expected_kept
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.prompts import encode_prompts
from ..zoo import PAIR_NAMES, ZOO_NAMES, build_zoo
from . import check_pairs, constants, study_header, write_results
from .never_behind import DEFAULT_PROMPTS


def look_of(pair, ids, temp: float) -> list:
    """The look's readings in one call of the defaults (a few tokens: the look comes first)."""
    seen = []
    original = AdaptivePolicy.observe_prompt_look

    def record(self, source, acceptance, rows, **options):
        seen.append(acceptance)
        return original(self, source, acceptance, rows, **options)
    with constants(AdaptivePolicy, observe_prompt_look=record), \
            constants(policy_module, GREEDY_LOOK=True,  # (off by default)
                      LOOK_BUDGET=False):  # every row: a two-token call's budget buys none
        for _ in speculative_generate_step(ids, pair.target_model, pair.draft_model, max_tokens=2,
                                           sampling=SamplingConfig(temp=temp), calibration=None,
                                           **pair.draft_options):
            pass
    return seen


def rounds_acceptance(pair, ids, temp: float, tokens: int, k: int) -> tuple:
    """(kept, rejections) over a reply at fixed k, as the policy's estimate counts them."""
    kept = rejections = 0.0
    for r in speculative_generate_step(ids, pair.target_model, pair.draft_model, max_tokens=tokens,
                                       sampling=SamplingConfig(temp=temp), num_draft_tokens=k,
                                       prompt_lookup=False, calibration=None, **pair.draft_options):
        if r.chances:
            a, b = expected_kept(r.chances)
        elif r.num_drafted:
            a, b = r.num_accepted, float(r.num_accepted < r.num_drafted)
        else:
            continue
        kept, rejections = kept + a, rejections + b
    return kept, rejections


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(ZOO_NAMES))
    parser.add_argument("--temps", default="0,0.7,1")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--out", default="prompt-look-accuracy")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, PAIR_NAMES)
    if not policy_module.PROMPT_LOOK:
        parser.error("policy.PROMPT_LOOK is off: there is no look to measure.")
    rows = []
    for pair in build_zoo(args.pairs.split(",")):
        prompts = [ids for p, ids in encode_prompts(pair.tokenizer) if p.name in DEFAULT_PROMPTS]
        for temp in (float(t) for t in args.temps.split(",")):
            looks, kept, rejections = [], 0.0, 0.0
            for ids in prompts:
                looks += look_of(pair, ids, temp)
                a, b = rounds_acceptance(pair, ids, temp, args.tokens, args.k)
                kept, rejections = kept + a, rejections + b
            rounds = kept / (kept + rejections) if kept + rejections else None
            rows.append({"pair": pair.name, "temp": temp, "looks": [round(x, 3) for x in looks],
                         "rounds": None if rounds is None else round(rounds, 3)})
            print(f"{pair.name}, T={temp:g}: look {looks}, rounds {rounds}", flush=True)
    header = study_header("prompt_look", argv, tokens=args.tokens, k=args.k)
    lines = ["# The prompt look against the rounds: a source's acceptance read before and after", "",
             f"`{header['command']}`  ", f"{header['machine']}; prompts "
             f"{', '.join(DEFAULT_PROMPTS)}; rounds: a reply of {args.tokens} tokens at k = {args.k}, "
             "no prompt lookup, uncalibrated. Look: the mean chance over the prompt's last "
             "positions, per prompt (at T = 0 the share whose argmaxes agree).", "",
             "| pair | T | look per prompt | mean look | per-draft acceptance in the rounds |",
             "|---|---|---|---|---|"]
    for row in rows:
        looks = row["looks"]
        mean = f"{statistics.mean(looks):.2f}" if looks else "-"
        rounds = "-" if row["rounds"] is None else f"{row['rounds']:.2f}"
        lines.append(f"| {row['pair']} | {row['temp']:g} | "
                     f"{', '.join(f'{x:.2f}' for x in looks) or '-'} | {mean} | {rounds} |")
    write_results(args.out, header, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
