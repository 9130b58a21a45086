"""A second chat turn on a reused prompt cache against the same turn decoded fresh.

    python -m bench.studies.multiturn_reuse [--tokens 96] [--repeats 2] [--out NAME]
        [--live true,false]

mlx-lm's multi-turn pattern through the Python API, on the shipped pair
(draft model, greedy, default arguments): turn 1 with
`stream_generate(..., prompt_cache=cache)`, then turn 2 (a follow-up) on the
same cache; against the same turn 2 decoded fresh from turn 1's whole text
(prompt + answer + follow-up) with no cache. For every code prompt and repeat
the configurations run back to back in one process (order alternating), and
the texts must be equal. Reported: decode speed (`generation_tps` of the last
response: prefill excluded), the ratio reused / fresh per prompt and repeat,
its median and range. `--live` lists the `prompt_cache_live` settings to run
(default: the default only). Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
from mlx_spec.bench.prompts import PROMPTS
from mlx_spec.bench.timing import median
from . import RESULTS_DIR

FOLLOW_UP = "\n\n# Now the same again, with a docstring:\n"


def two_turns(target, draft, tokenizer, first: str, tokens: int, **kwargs):
    """(turn-2 text, turn-2 decode tokens/s) on a cache reused from turn 1."""
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    answer = "".join(r.text for r in mlx_spec.stream_generate(
        target, tokenizer, first, draft_model=draft, max_tokens=tokens, prompt_cache=cache, **kwargs))
    last = None
    text = ""
    for last in mlx_spec.stream_generate(target, tokenizer, FOLLOW_UP, draft_model=draft,
                                         max_tokens=tokens, prompt_cache=cache, **kwargs):
        text += last.text
    return answer, text, last.generation_tps


def fresh_turn(target, draft, tokenizer, whole: str, tokens: int):
    last = None
    text = ""
    for last in mlx_spec.stream_generate(target, tokenizer, whole, draft_model=draft,
                                         max_tokens=tokens):
        text += last.text
    return text, last.generation_tps


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--live", default="default",
                    help="comma-separated prompt_cache_live settings: default, true, false")
    ap.add_argument("--out", default=None, help="results file name (default: none written)")
    args = ap.parse_args(argv)
    settings = {"default": {}, "true": {"prompt_cache_live": True},
                "false": {"prompt_cache_live": False}}
    lives = [s.strip() for s in args.live.split(",")]
    target, draft, tokenizer = mlx_spec.load_default_pair()
    prompts = [p for p in PROMPTS if p.kind == "code"]
    two_turns(target, draft, tokenizer, prompts[0].text, 16)  # warm up
    ratios = {live: [] for live in lives}
    speeds = {live: [] for live in lives}
    fresh_speeds = []
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            answer, _, _ = two_turns(target, draft, tokenizer, prompt.text, args.tokens)
            whole = prompt.text + answer + FOLLOW_UP
            runs = ["fresh"] + lives
            if (i + rep) % 2:
                runs.reverse()
            got = {}
            for run in runs:
                if run == "fresh":
                    got[run] = fresh_turn(target, draft, tokenizer, whole, args.tokens)
                else:
                    _, text, tps = two_turns(target, draft, tokenizer, prompt.text, args.tokens,
                                             **settings[run])
                    got[run] = (text, tps)
            fresh_text, fresh_tps = got["fresh"]
            fresh_speeds.append(fresh_tps)
            for live in lives:
                assert got[live][0] == fresh_text, f"turn 2 differs on {prompt.name} ({live})"
                speeds[live].append(got[live][1])
                ratios[live].append(got[live][1] / fresh_tps)
            print(f"{prompt.name} rep {rep + 1}: fresh {fresh_tps:.1f} tok/s, "
                  + ", ".join(f"reused ({live}) {got[live][1]:.1f}" for live in lives), flush=True)
    blas = "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference (netlib)"
    rows = {live: {"median_reused_over_fresh": round(median(ratios[live]), 3),
                   "range": [round(min(ratios[live]), 3), round(max(ratios[live]), 3)],
                   "median_reused_tokens_per_s": round(median(speeds[live]), 1),
                   "ratios": [round(r, 3) for r in ratios[live]]}
            for live in lives}
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "blas": blas,
              "mlx": mx.__version__, "pair": "shipped (float16)", "tokens": args.tokens,
              "repeats": args.repeats, "prompts": [p.name for p in prompts], "greedy": True,
              "median_fresh_tokens_per_s": round(median(fresh_speeds), 1), "prompt_cache_live": rows}
    lines = [f"# Turn 2 on a reused prompt cache vs fresh ({blas})", "",
             f"{result['machine']}, MLX {result['mlx']}, shipped pair, draft model, greedy, default "
             f"arguments, {args.tokens} tokens per turn, {len(prompts)} code prompts x {args.repeats} "
             "repeats, interleaved; `python -m bench.studies.multiturn_reuse "
             f"{' '.join(argv)}`. Decode speed = generation_tps (prefill excluded; a reused "
             "turn's prefill also runs what settling turn 1 left lazy).", "",
             f"Fresh turn 2: median {result['median_fresh_tokens_per_s']} tokens/s.", "",
             "| prompt_cache_live | reused / fresh (median) | range | reused tokens/s |", "|---|---|---|---|"]
    for live, r in rows.items():
        lines.append(f"| {live} | {r['median_reused_over_fresh']:.2f}x | {r['range'][0]:.2f}-"
                     f"{r['range'][1]:.2f} | {r['median_reused_tokens_per_s']} |")
    print("\n".join(lines))
    if args.out:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS_DIR / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
