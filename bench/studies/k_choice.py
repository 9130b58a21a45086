"""Which k do the defaults draft, and what does each k make? The defaults against fixed k.

    python -m bench.studies.k_choice --pairs shipped-f16,strong --temps 0.7,1 \\
        --out k-choice-tuned

A never-behind row says the defaults trail the best fixed k; this says where. For each
pair and T the defaults (uncalibrated, prompt lookup in front as shipped) and mlx-spec at
each fixed `--ks` (the pair's drafter, no lookup) decode the never-behind prompts,
`--repeats` each, interleaved (the order reversed every other repeat, one seed per repeat,
the first round, which carries the prefill, untimed). Per method: decode tokens/s and, per
k drafted, the drafter's rounds, their median time (each round's time is the gap between
two rounds arriving) and the tokens they emitted. For the defaults also the acceptance
estimate its policy held (the mean over its drafter's rounds after the first three) against
the acceptance those rounds realized (kept drafts over the positions they reached), and
each fixed k's tokens/s divided by theirs (paired median). Writes bench/results/<out>.json
and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Dict, List, Sequence

from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.endtoend import RunResult, interleave
from mlx_spec.bench.prompts import encode_prompts
from mlx_spec.bench.timing import median, time_after_prefill
from ..zoo import ZOO_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .never_behind import DEFAULT_PROMPTS

DEFAULTS = "defaults"
SKIPPED_ROUNDS = 3  # the estimate is read after the drafter's first rounds (the cold start)
WARMUP = 1  # runs of each method before the counted ones (one prompt)


def fixed(k: int) -> str:
    return f"k={k}"


class Tally:
    """One method's rounds: time and tokens per k drafted, decode speed per run."""

    def __init__(self):
        self.round_ms: Dict[int, List[float]] = defaultdict(list)
        self.round_tokens: Dict[int, List[int]] = defaultdict(list)
        self.tokens_per_s: List[float] = []
        self.estimates: List[float] = []  # the policy's acceptance before each round (defaults)
        self.kept = self.reached = 0  # realized: kept drafts, positions reached

    def run(self, rounds, policy=None) -> RunResult:
        """Consume one generation's rounds (the first, with the prefill, untimed)."""
        last, seen = None, 0

        def each(round_) -> None:
            nonlocal last, seen
            now = time.perf_counter()
            if last is not None and round_.num_drafted and round_.source != "lookup":
                seen += 1
                self.round_ms[round_.num_drafted].append((now - last) * 1000)
                self.round_tokens[round_.num_drafted].append(len(round_.tokens))
                if policy is not None and seen > SKIPPED_ROUNDS:
                    self.estimates.append(policy.source(round_.source).acceptance)
                    self.kept += round_.num_accepted
                    self.reached += min(round_.num_accepted + 1, round_.num_drafted)
            last = now

        decoded = time_after_prefill(rounds, each)
        self.tokens_per_s.append(decoded.tokens_per_s)
        return RunResult(decoded.seconds, decoded.tokens, decoded.drafted, decoded.accepted)

    def per_k(self) -> Dict[int, dict]:
        return {k: {"rounds": len(ms), "median_ms": round(median(ms), 2),
                    "tokens_per_round": round(statistics.mean(self.round_tokens[k]), 3)}
                for k, ms in sorted(self.round_ms.items())}


def measure(target_model, draft_model, prompts: Sequence[List[int]], temp: float,
            ks: Sequence[int], repeats: int, tokens: int, draft_options=None,
            defaults_options=None) -> dict:
    """One pair at one T: the defaults and each fixed k, interleaved (see the module doc).
    `defaults_options`: more keyword arguments for the defaults' runs (the study passes
    none: the defaults as shipped)."""
    options = dict(draft_options or {})
    methods = {DEFAULTS: dict(calibration=None, **(defaults_options or {})), **{
        fixed(k): dict(num_draft_tokens=k, prompt_lookup=False) for k in ks}}
    tallies = {name: Tally() for name in methods}
    calls = {name: 0 for name in methods}

    def run(name: str, ids: List[int]) -> RunResult:
        calls[name] += 1  # the first call of each: interleave's warm-up, not counted
        stream = speculative_generate_step(ids, target_model, draft_model, max_tokens=tokens,
                                           sampling=SamplingConfig(temp=temp),
                                           **methods[name], **options)
        tally = tallies[name] if calls[name] > WARMUP else Tally()
        return tally.run(stream, stream.policy if name == DEFAULTS else None)

    interleave({name: (lambda ids, name=name: run(name, ids)) for name in methods},
               [(None, ids) for ids in prompts], repeats * len(prompts), WARMUP)
    base = tallies[DEFAULTS]
    row = {"methods": {name: {"tokens_per_s": round(median(t.tokens_per_s), 2),
                              "per_k": t.per_k()} for name, t in tallies.items()}}
    row["estimate"] = round(statistics.mean(base.estimates), 3) if base.estimates else None
    row["realized"] = round(base.kept / base.reached, 3) if base.reached else None
    row["fixed_over_defaults"] = {
        fixed(k): round(median([a / b for a, b in zip(tallies[fixed(k)].tokens_per_s,
                                                      base.tokens_per_s) if b]), 3)
        for k in ks}
    return row


def _markdown(header: dict, rows: list) -> str:
    lines = ["# Which k the defaults draft, against fixed k", "",
             f"`{header['command']}`  ",
             f"{header['machine']}; {header['tokens']} tokens per run, {header['repeats']} "
             f"repeats of the prompts {', '.join(DEFAULT_PROMPTS)}, the defaults "
             "uncalibrated.", "",
             "| pair | T | method | tok/s | fixed ÷ defaults | rounds at each k: count, "
             "median ms, tokens per round |", "|---|---|---|---|---|---|"]
    for row in rows:
        for name, method in row["methods"].items():
            ratio = row["fixed_over_defaults"].get(name)
            per_k = "; ".join(f"k={k}: {v['rounds']}, {v['median_ms']}, {v['tokens_per_round']}"
                              for k, v in method["per_k"].items())
            lines.append(f"| {row['pair']} | {row['temp']:g} | {name} | "
                         f"{method['tokens_per_s']} | {'-' if ratio is None else f'{ratio}x'} "
                         f"| {per_k or '-'} |")
    lines += ["", "| pair | T | the defaults' acceptance estimate | realized by those rounds |",
              "|---|---|---|---|"]
    lines += [f"| {row['pair']} | {row['temp']:g} | {row['estimate']} | {row['realized']} |"
              for row in rows]
    lines += ["", "Estimate: the mean of the policy's per-draft acceptance before each of its "
              f"drafter's rounds after the first {SKIPPED_ROUNDS}; realized: those rounds' "
              "kept drafts over the positions they reached (each kept draft and the first "
              "rejected one). The mean over rounds weighs hard stretches (short rounds) more "
              "than the count over positions does."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="shipped-f16,strong")
    parser.add_argument("--temps", default="0.7,1")
    parser.add_argument("--ks", default="1,2,3,4")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default="k-choice")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, ZOO_NAMES)
    try:
        ks = [int(k) for k in args.ks.split(",")]
        temps = [float(t) for t in args.temps.split(",")]
    except ValueError:
        parser.error("--ks takes integers and --temps numbers, separated by commas.")
    if not ks or min(ks) < 1:
        parser.error("--ks takes integers of 1 or more.")
    if args.repeats < 1 or args.tokens < 1:
        parser.error("--repeats and --tokens take integers of 1 or more.")
    rows = []
    for pair in build_zoo(args.pairs.split(",")):
        prompts = [ids for p, ids in encode_prompts(pair.tokenizer) if p.name in DEFAULT_PROMPTS]
        for temp in temps:
            row = measure(pair.target_model, pair.draft_model, prompts, temp, ks, args.repeats,
                          args.tokens, pair.draft_options)
            rows.append({"pair": pair.name, "temp": temp, **row})
            print(f"{pair.name}, T={temp:g}: estimate {row['estimate']}, realized "
                  f"{row['realized']}, fixed ÷ defaults {row['fixed_over_defaults']}", flush=True)
    header = study_header("k_choice", argv, tokens=args.tokens, repeats=args.repeats, ks=ks)
    write_results(args.out, header, rows, _markdown(header, rows))


if __name__ == "__main__":
    main()
