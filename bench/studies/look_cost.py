"""What the prompt look costs before the first token, and what it buys over a whole reply.

    python -m bench.studies.look_cost --out look-cost-netlib
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m bench.studies.look_cost --out look-cost-openblas
    python -m bench.studies.look_cost --chunking --pairs shipped-f32 --temps 0.7 \\
        --prompt-tokens 40,150,500 --out NAME    # the look's own prefill chunk, with and without
    python -m bench.studies.look_cost --rows 4,8,16,32 --temps 0.7 --out NAME

The never-behind and long-replies tables time a reply from its first token on,
so they never see the look (mlx_spec/prompt_look.py): it runs after the
prefill, before the first token (the target's and each drafter's output layer
over the prompt's last rows, and the last layer's rows it needs). Here each
call of the defaults (uncalibrated, prompt lookup as the defaults set it) is
timed from the call: the time to its first token and to the whole reply of
`--tokens`, with the look on and off (greedy: policy.GREEDY_LOOK; at T > 0:
policy.PROMPT_LOOK, which there also sets the prior; on, the look takes the
rows policy.LOOK_BUDGET buys it, perhaps none), interleaved per prompt,
the order reversed every other repeat. Reported: the look's median cost to the
first token (paired differences), in milliseconds and in the pair's plain
steps (a plain step: the median of plain decoding's steps on the same
prompts), and the whole reply's time without the look over with it (above 1:
the look pays for itself). `--chunking`: instead, the look's extra time in a
two-token call with its rows a prefill chunk of their own (TAIL_CHUNK_FROM = 1)
and without (never), every row (LOOK_BUDGET off), against no look, on prompts of `--prompt-tokens` N,... tokens
(the never-behind prompts repeated). `--rows`: instead, the look's own time at
each row count, in prompt tokens of prefill and in plain steps (measure_rows:
what policy.LOOK_FIXED_TOKENS and LOOK_ROW_TOKENS were read from). Writes
bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List

import mlx.core as mx

from mlx_spec import loop as loop_module
from mlx_spec import policy as policy_module
from mlx_spec import prompt_look
from mlx_spec.cache import prefill as prefill_module
from mlx_spec.generate import speculative_generate_step
from mlx_spec.policy import AdaptivePolicy
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.endtoend import run_target_alone
from mlx_spec.bench.prompts import PROMPTS, encode_prompts
from mlx_spec.bench.timing import median_interval
from ..zoo import PAIR_NAMES, TUNED_NAMES, build_zoo
from . import check_pairs, constants, parse_temps, study_header, write_results
from .never_behind import DEFAULT_PROMPTS


def flag_for(temp: float) -> str:
    """The rule that turns the look on or off at `temp`."""
    return "GREEDY_LOOK" if temp == 0 else "PROMPT_LOOK"


def timed_call(pair, ids, temp: float, tokens: int, look: bool) -> tuple:
    """(seconds to the first token, seconds to the whole reply) of one call of the defaults."""
    with constants(policy_module, **{flag_for(temp): look}):
        start = time.perf_counter()
        first = None
        for _ in speculative_generate_step(ids, pair.target_model, pair.draft_model,
                                           max_tokens=tokens, sampling=SamplingConfig(temp=temp),
                                           calibration=None, **pair.draft_options):
            if first is None:
                first = time.perf_counter() - start
        return first, time.perf_counter() - start


def prompts_of(pair, lengths: List[int]) -> List[tuple]:
    """(length, prompts): the never-behind prompts as they are (length None), or each repeated
    and cut to the last `length` tokens."""
    by_name = {p.name: p for p in PROMPTS}
    base = [ids for _, ids in encode_prompts(pair.tokenizer, [by_name[n] for n in DEFAULT_PROMPTS])]
    if not lengths:
        return [(None, base)]
    return [(n, [(ids * (n // len(ids) + 1))[-n:] for ids in base]) for n in lengths]


def measure_chunking(pair_names: List[str], temps: List[float], lengths: List[int],
                     repeats: int) -> List[dict]:
    """A call of two tokens (the look comes after the first) without the look, and the look's
    extra with its own prefill chunk and without, per prompt length (medians of paired
    differences, the order rotated each repeat)."""
    rows = []
    modes = {"no look": None, "own chunk": 1, "undivided": 10 ** 9}
    for pair in build_zoo(pair_names):
        for n, prompts in prompts_of(pair, lengths):
            for temp in temps:
                seen = {mode: [] for mode in modes}
                for r in range(1 + repeats):
                    names = list(modes)[r % 3:] + list(modes)[:r % 3]
                    for mode in names:
                        chunk_from = modes[mode] or prefill_module.TAIL_CHUNK_FROM
                        with constants(prefill_module, TAIL_CHUNK_FROM=chunk_from), \
                                constants(policy_module, LOOK_BUDGET=False):  # (2 tokens buy none)
                            _, seconds = timed_call(pair, prompts[r % len(prompts)], temp, 2,
                                                    modes[mode] is not None)
                        if r:
                            seen[mode].append(seconds)
                base = statistics.median(seen["no look"])
                row = {"pair": pair.name, "temp": temp, "prompt_tokens": n,
                       "two_tokens_ms": base * 1e3,
                       **{f"{mode} ms": (statistics.median(
                           [a - b for a, b in zip(seen[mode], seen["no look"])])) * 1e3
                          for mode in ("own chunk", "undivided")}}
                rows.append(row)
                print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def measure_rows(pair_names: List[str], temps: List[float], counts: List[int],
                 repeats: int) -> List[dict]:
    """The look's own time (loop._take_look, after the first round of a two-token call) at
    each row count, forced (policy.look_rows), with the draft never off before it
    (COSTLY_DRAFT_OFF off), in the target's prompt tokens of prefill (the call's own prefill
    time per token) and in plain steps (policy.steady_step_seconds then); medians, the counts
    in rotating order. A line through the medians gives the look's fixed cost and its cost
    per row, in prompt tokens (policy.LOOK_FIXED_TOKENS, LOOK_ROW_TOKENS)."""
    seen = {}

    def timed_look(policy, looks, sampling, most, per_token, max_tokens):
        start = time.perf_counter()
        take_look(policy, looks, sampling, most, per_token, max_tokens)
        seen.update(seconds=time.perf_counter() - start, per_token=per_token,
                    step=policy.steady_step_seconds())

    def observed(self, source, acceptance, count, **options):  # the rows actually compared
        seen["rows"] = count
        return observe(self, source, acceptance, count, **options)
    take_look, observe = loop_module._take_look, AdaptivePolicy.observe_prompt_look
    rows = []
    for pair in build_zoo(pair_names):
        (_, prompts), = prompts_of(pair, [])
        for temp in temps:
            looks = {count: [] for count in counts}
            for r in range(1 + repeats):
                for count in counts[r % len(counts):] + counts[:r % len(counts)]:
                    seen.clear()
                    with constants(loop_module, _take_look=timed_look), \
                            constants(policy_module, COSTLY_DRAFT_OFF=False, PROMPT_LOOK=True), \
                            constants(AdaptivePolicy, observe_prompt_look=observed,
                                      look_rows=lambda self, *_, n=count: n):
                        timed_call(pair, prompts[r % len(prompts)], temp, 2, True)
                    if r and seen.get("per_token") and seen.get("step") and seen.get("rows"):
                        looks[count].append((seen["seconds"], seen["per_token"], seen["step"],
                                             seen["rows"]))
            timed = [n for n in counts if looks[n]]
            if not timed:
                print(f"  {pair.name}, T={temp:g}: no look was taken", file=sys.stderr, flush=True)
                continue
            compared = {n: statistics.median(c for *_, c in looks[n]) for n in timed}
            tokens = {n: statistics.median(s / t for s, t, _, _ in looks[n]) for n in timed}
            steps = {n: statistics.median(s / p for s, _, p, _ in looks[n]) for n in timed}
            per_token = statistics.median(t / p for n in timed for _, t, p, _ in looks[n])
            fixed, per_row = _line({compared[n]: tokens[n] for n in timed})
            row = {"pair": pair.name, "temp": temp, "prefill_token_steps": per_token,
                   "rows_compared": {str(n): compared[n] for n in timed},
                   "look_tokens": {str(n): tokens[n] for n in timed},
                   "look_steps": {str(n): steps[n] for n in timed},
                   "fixed_tokens": fixed, "row_tokens": per_row}
            rows.append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def _line(points: dict) -> tuple:
    """(intercept, slope) of the least-squares line through {x: y} (None with fewer than 2)."""
    if len(points) < 2:
        return None, None
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / \
        sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def measure(pair_names: List[str], temps: List[float], tokens: int, repeats: int) -> List[dict]:
    rows = []
    for pair in build_zoo(pair_names):
        (_, prompts), = prompts_of(pair, [])
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


def render_chunking(rows: List[dict], header: dict) -> str:
    out = ["# The prompt look with its rows a prefill chunk of their own, and without", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; the defaults uncalibrated, a call of 2 tokens (the look comes "
           f"after the first), median of {header['repeats']} repeats after a warm-up, the three "
           "modes in rotating order; the never-behind prompts repeated to each length.", "",
           "| pair | T | prompt tokens | 2 tokens without the look, ms | the look with its own "
           "chunk, ms | the look undivided, ms |", "|---|---|---|---|---|---|"]
    for row in rows:
        out.append(f"| {row['pair']} | {row['temp']:g} | {row['prompt_tokens']} | "
                   f"{row['two_tokens_ms']:.1f} | {row['own chunk ms']:.1f} | "
                   f"{row['undivided ms']:.1f} |")
    return "\n".join(out) + "\n"


def render_rows(rows: List[dict], header: dict) -> str:
    counts = list(rows[0]["look_tokens"]) if rows else []
    out = ["# The prompt look's own time by the rows it compares", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; the defaults uncalibrated, a call of 2 tokens (the look comes "
           "after the first), the look's rows forced, the draft never off before it; median of "
           f"{header['repeats']} repeats after a warm-up, the counts in rotating order (prompts "
           f"{', '.join(DEFAULT_PROMPTS)} in turn). The look's time in the target's "
           "prompt tokens of prefill (that call's prefill time per token) and, in brackets, in "
           "plain steps (the policy's estimate then), and the rows compared where fewer than "
           "asked (the prompt has fewer); fixed and per row: the line through them over the rows "
           "compared, in prompt tokens.", "",
           "| pair | T | a prompt token's prefill, in plain steps | "
           + " | ".join(f"{n} rows" for n in counts) + " | fixed | per row |",
           "|---|---|---|" + "---|" * len(counts) + "---|---|"]
    for row in rows:
        compared = row.get("rows_compared", {})
        cells = [f"{row['look_tokens'][n]:.1f} ({row['look_steps'][n]:.1f})"
                 + (f", {compared[n]:g} compared" if n in compared and compared[n] != int(n) else "")
                 if n in row["look_tokens"] else "-" for n in counts]
        fixed, per_row = row["fixed_tokens"], row["row_tokens"]
        out.append(f"| {row['pair']} | {row['temp']:g} | {row['prefill_token_steps']:.3f} | "
                   + " | ".join(cells) + " | "
                   + ("-" if fixed is None else f"{fixed:.1f}") + " | "
                   + ("-" if per_row is None else f"{per_row:.2f}") + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=",".join(TUNED_NAMES))
    parser.add_argument("--temps", default="0,0.7")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="look-cost")
    parser.add_argument("--chunking", action="store_true",
                        help="the look's own prefill chunk against none (see the module's text)")
    parser.add_argument("--prompt-tokens", default="40,150,500",
                        help="with --chunking: prompt lengths, comma-separated")
    parser.add_argument("--rows", default=None,
                        help="the look's own time at each of these row counts, comma-separated "
                             "(see measure_rows)")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, PAIR_NAMES)
    temps = parse_temps(parser, args.temps)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be >= 1.")
    if args.chunking and args.rows is not None:
        parser.error("--chunking and --rows are two different studies: choose one.")
    header = study_header("look_cost", argv, tokens=args.tokens, repeats=args.repeats)
    if args.chunking:
        try:
            lengths = [int(n) for n in args.prompt_tokens.split(",")]
        except ValueError:
            parser.error(f"--prompt-tokens takes integers separated by commas, "
                         f"got {args.prompt_tokens!r}.")
        if min(lengths) < 8:
            parser.error("--prompt-tokens must be >= 8 (the look needs prompt rows).")
        rows = measure_chunking(args.pairs.split(","), temps, lengths, args.repeats)
        write_results(args.out, header, rows, render_chunking(rows, header))
        return 0
    if args.rows is not None:
        try:
            counts = [int(n) for n in args.rows.split(",")]
        except ValueError:
            parser.error(f"--rows takes integers separated by commas, got {args.rows!r}.")
        if min(counts) < prompt_look.MIN_ROWS or max(counts) > prompt_look.ROWS:
            parser.error(f"--rows must be between {prompt_look.MIN_ROWS} and {prompt_look.ROWS}.")
        if 0 in temps:
            parser.error("--rows measures the look at T > 0 (greedy it is policy.GREEDY_LOOK's).")
        rows = measure_rows(args.pairs.split(","), temps, counts, args.repeats)
        write_results(args.out, header, rows, render_rows(rows, header))
        return 0
    rows = measure(args.pairs.split(","), temps, args.tokens, args.repeats)
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
