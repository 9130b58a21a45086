"""A single sequence through the batch engine (a batch of one) against the loop (loop.py).

    python -m bench.studies.batch_of_one --out batch-of-one-netlib

Issue 62 asks for one engine: a single sequence as a batch of one, if the batch engine
decodes one row as fast as the loop decodes a call. For each pair and temperature, each
repeat decodes one of the never-behind prompts (in turn) with `speculative_generate_step`
(the loop) and with a fresh `BatchEngine` holding that one row, both with the pair's drafter,
the defaults otherwise (adaptive k, prompt lookup as `generate`'s) and no calibration, the
order reversed every other repeat; with `-k K` both draft a fixed K with the model drafter alone
(no lookup): the engines' own cost at equal work, with no policy choosing. Each is timed after its first output (which carries the
prefill and the first token), as the never-behind tables time a call. Ratio: the batch's
tokens per second ÷ the loop's, the median of the per-repeat ratios with an order-statistics
interval. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import time

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.bench.prompts import encode_prompts
from mlx_spec.bench.timing import median, time_after_prefill
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from ..zoo import ZOO_NAMES, build_zoo
from . import check_pairs, paired_ratio, parse_temps, study_header, write_results
from .never_behind import DEFAULT_PROMPTS

DEFAULT_PAIRS = "shipped-f16,shipped-f32,hybrid-f32,mtp-f32"
LOOP, BATCH = "loop", "batch of one"


def loop_rate(pair, ids, temp: float, tokens: int, k=None) -> float:
    fixed = {} if k is None else {"num_draft_tokens": k, "prompt_lookup": False}
    decoded = time_after_prefill(speculative_generate_step(
        ids, pair.target_model, pair.draft_model, max_tokens=tokens,
        sampling=SamplingConfig(temp=temp), calibration=None, **pair.draft_options, **fixed))
    return decoded.tokens / decoded.seconds


def batch_rate(pair, ids, temp: float, tokens: int, k=None) -> float:
    engine = BatchEngine(pair.target_model, pair.draft_model, calibration=None,
                         tokenizer=pair.tokenizer, num_draft_tokens=k, **pair.draft_options)
    engine.insert(RowRequest(ids, tokens, SamplingConfig(temp=temp),
                             prompt_lookup=None if k is None else False))
    start, n = None, 0
    while engine.busy:
        for out in engine.step():
            if start is None:
                start = time.perf_counter()
            else:
                n += len(out.tokens)
    return n / (time.perf_counter() - start)


def measure(args) -> list:
    rows = []
    engines = {LOOP: loop_rate, BATCH: batch_rate}
    for pair in build_zoo(args.pairs.split(",")):
        prompts = [ids for p, ids in encode_prompts(pair.tokenizer) if p.name in DEFAULT_PROMPTS]
        for temp in parse_temps(None, args.temps):
            for name, rate in engines.items():  # warm-up
                rate(pair, prompts[0], temp, args.tokens, args.k)
            rates = {name: [] for name in engines}
            for repeat in range(args.repeats):
                ids = prompts[repeat % len(prompts)]
                for name in (list(engines) if repeat % 2 == 0 else list(engines)[::-1]):
                    rates[name].append(engines[name](pair, ids, temp, args.tokens, args.k))
            r = paired_ratio(rates[BATCH], rates[LOOP])
            rows.append({"pair": pair.name, "temp": temp, "tokens_per_s": rates, "ratio": r})
            print(f"{pair.name}, T={temp:g}: batch of one ÷ loop {r['median']:.3f} "
                  f"({r['low']:.2f}-{r['high']:.2f})", flush=True)
    return rows


def render(header: dict, rows: list, args) -> str:
    lines = ["# A single sequence: the batch engine (a batch of one) against the loop", "",
             f"`{header['command']}`  ", f"{header['machine']}; prompts "
             f"{', '.join(DEFAULT_PROMPTS)} in turn, {args.repeats} repeats, {args.tokens} "
             "tokens, " + ("the defaults (adaptive k, lookup)" if args.k is None else
                           f"a fixed k = {args.k}, the model drafter alone (no lookup)") +
             ", no calibration, each timed after "
             "its first output, the order reversed every other repeat. Ratio: the batch's "
             "tokens/s ÷ the loop's, the median of the per-repeat ratios (in brackets its "
             "order-statistics interval).", "",
             "| pair | T | loop tokens/s | batch of one tokens/s | batch ÷ loop |",
             "|---|---|---|---|---|"]
    for row in rows:
        r = row["ratio"]
        lines.append(f"| {row['pair']} | {row['temp']:g} | "
                     f"{median(row['tokens_per_s'][LOOP]):.1f} | "
                     f"{median(row['tokens_per_s'][BATCH]):.1f} | "
                     f"{r['median']:.3f}x ({r['low']:.2f}-{r['high']:.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=DEFAULT_PAIRS)
    parser.add_argument("--temps", default="0,0.7")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("-k", "--k", type=int, default=None,
                        help="a fixed k, the model drafter alone (no lookup): the engines' own "
                             "cost at equal work, no policy (default: the defaults)")
    parser.add_argument("--out", default="batch-of-one")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, ZOO_NAMES)
    parse_temps(parser, args.temps)
    if args.repeats < 1 or args.tokens < 8 or (args.k is not None and args.k < 1):
        parser.error("--repeats must be >= 1, --tokens >= 8 and -k >= 1.")
    rows = measure(args)
    header = study_header("batch_of_one", argv, tokens=args.tokens, repeats=args.repeats)
    write_results(args.out, header, rows, render(header, rows, args))


if __name__ == "__main__":
    main()
