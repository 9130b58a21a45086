"""mlx-spec's plain decoding against mlx-lm's: the same target, no drafter, seconds per token.

    python -m bench.studies.plain_loop --out plain-loop-openblas   # (OpenBLAS preload)

Where the defaults switch every source off they decode with mlx-spec's own
plain steps, and the never-behind tables hold them against mlx-lm's
generate_step. For each pair (its target only) and temperature, each repeat
decodes one of the never-behind prompts (in turn), from a cache prefilled
untimed, with mlx-lm's generate_step and with mlx-spec's loop (no drafter, no
lookup), and with `--uncompiled` also with mlx-spec's loop drawing through an
uncompiled mx.random.categorical (the sampler before it was compiled),
`--tokens` tokens each, the order reversed every other repeat. Ratios: mlx-lm's
seconds per token ÷ each mlx-spec loop's, the median of the per-repeat ratios
with an order-statistics interval. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_spec import sampling as sampling_module
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.endtoend import _prefilled, run_target_alone
from mlx_spec.bench.prompts import encode_prompts
from mlx_spec.bench.timing import median, median_interval
from ..zoo import ZOO_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .never_behind import DEFAULT_PROMPTS

DEFAULT_PAIRS = "skip-f32,hybrid-f32,sliding-f32,mtp-f32,hybrid-skip-f32,shipped-f16"
MLX_LM, COMPILED, UNCOMPILED = "mlx-lm", "mlx-spec", "mlx-spec, uncompiled draw"


def mlx_spec_plain(target_model, ids, temp: float, tokens: int) -> float:
    """Seconds per token of mlx-spec's loop decoding `tokens` with no drafter."""
    cache = _prefilled(target_model, ids)
    start, n = time.perf_counter(), 0
    for round_ in speculative_generate_step(ids[-1:], target_model, None, max_tokens=tokens,
                                            sampling=SamplingConfig(temp=temp),
                                            prompt_cache=cache, prompt_lookup=False):
        n += len(round_.tokens)
    return (time.perf_counter() - start) / n


def uncompiled_draw(logprobs: mx.array) -> mx.array:
    return mx.random.categorical(logprobs, axis=-1)


def paired(mlx_lm: list, mlx_spec: list) -> dict:
    """mlx-lm's seconds ÷ mlx-spec's (its speed over mlx-lm's), repeat by repeat: median and
    interval."""
    per_repeat = [a / b for a, b in zip(mlx_lm, mlx_spec)]
    low, high, coverage = median_interval(per_repeat)
    return {"median": median(per_repeat), "low": low, "high": high, "coverage": coverage}


def measure(args) -> list:
    methods = [MLX_LM, COMPILED] + ([UNCOMPILED] if args.uncompiled else [])
    compiled_draw = sampling_module._categorical
    rows = []
    for pair in build_zoo(args.pairs.split(",")):
        prompts = [ids for p, ids in encode_prompts(pair.tokenizer) if p.name in DEFAULT_PROMPTS]
        for temp in (float(t) for t in args.temps.split(",")):

            def run(method, ids):
                if method == MLX_LM:
                    result = run_target_alone(pair.target_model, ids, temp, args.tokens)
                    return result.seconds / result.tokens
                sampling_module._categorical = uncompiled_draw if method == UNCOMPILED \
                    else compiled_draw
                try:
                    return mlx_spec_plain(pair.target_model, ids, temp, args.tokens)
                finally:
                    sampling_module._categorical = compiled_draw

            for method in methods:  # warm-up
                run(method, prompts[0])
            seconds = {method: [] for method in methods}
            for repeat in range(args.repeats):
                ids = prompts[repeat % len(prompts)]
                for method in (methods if repeat % 2 == 0 else methods[::-1]):
                    seconds[method].append(run(method, ids))
            ratios = {method: paired(seconds[MLX_LM], seconds[method]) for method in methods[1:]}
            rows.append({"pair": pair.name, "temp": temp, "seconds": seconds,
                         "ratios": ratios})
            print(f"{pair.name}, T={temp:g}: " + ", ".join(
                f"{m} ÷ mlx-lm {r['median']:.3f}" for m, r in ratios.items()), flush=True)
    return rows


def render(header: dict, rows: list, args) -> str:
    methods = [COMPILED] + ([UNCOMPILED] if args.uncompiled else [])
    lines = ["# mlx-spec's plain decoding against mlx-lm's (the same target, no drafter)", "",
             f"`{header['command']}`  ", f"{header['machine']}; prompts "
             f"{', '.join(DEFAULT_PROMPTS)} in turn, {args.repeats} repeats, {args.tokens} "
             "tokens, caches prefilled untimed, the order reversed every other repeat. "
             "Tokens per second ÷ mlx-lm generate_step's on the same prompt: the median of "
             "the per-repeat ratios (in brackets its order-statistics interval).", "",
             "| pair | T | mlx-lm ms/token | " + " | ".join(f"{m} ÷ mlx-lm" for m in methods)
             + (" | uncompiled − compiled, ms/token" if args.uncompiled else "") + " |",
             "|---|---|---|" + "---|" * (len(methods) + args.uncompiled)]
    for row in rows:
        mlx_lm = median(row["seconds"][MLX_LM])
        cells = [f"{row['ratios'][m]['median']:.3f}x ({row['ratios'][m]['low']:.2f}-"
                 f"{row['ratios'][m]['high']:.2f})" for m in methods]
        if args.uncompiled:  # the draw's own cost, repeat by repeat (T = 0: a control)
            extra = [u - c for u, c in zip(row["seconds"][UNCOMPILED], row["seconds"][COMPILED])]
            cells.append(f"{1000 * median(extra):+.3f}")
        lines.append(f"| {row['pair']} | {row['temp']:g} | {1000 * mlx_lm:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default=DEFAULT_PAIRS)
    parser.add_argument("--temps", default="0,0.7")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--uncompiled", action="store_true",
                        help="also time mlx-spec's loop with an uncompiled categorical draw")
    parser.add_argument("--out", default="plain-loop")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, ZOO_NAMES)
    if args.repeats < 1 or args.tokens < 8:
        parser.error("--repeats must be >= 1 and --tokens >= 8.")
    rows = measure(args)
    header = study_header("plain_loop", argv, tokens=args.tokens, repeats=args.repeats)
    write_results(args.out, header, rows, render(header, rows, args))


if __name__ == "__main__":
    main()
