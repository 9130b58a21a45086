"""Accepted length per round of the shipped DFlash drafter against the shipped draft model and
MTP head, at equal verify length (blocks of 4, 8 and 16: k = 3, 7, 15 drafts), and each
source with the defaults (the adaptive policy, uncalibrated) against plain decoding.

    python -m bench.studies.dflash_acceptance [--dflash DIR] [--prompts 16] [--tokens 96]
        [--temp 0] [--out NAME]

`--dflash` names the drafter (default: the one shipped in
mlx_spec/default_models/dflash), e.g. one `python -m training.dflash` wrote.

Held-out prompts: the training script's `make_prompts` over the validation
modules (the same as mtp_speed's). With a fixed k every source drafts exactly
k tokens per round (no prompt lookup), so the rounds verify the same number of
tokens and only the proposals differ; "auto" is the default policy (k per
source, auto-off; no calibration, no prompt lookup, so the source alone is
measured); "plain" is the target decoding alone. Reported per source and k:
mean accepted drafts per speculative round, tokens per round (accepted + the
target's own), and tokens/s of the whole generation (prefill excluded) on this
machine, every configuration interleaved prompt by prompt, and its median
ratio to plain over prompts. Writes bench/results/<NAME>.json and .md. Run from
the repository root.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

from mlx_spec import load_default_pair
from mlx_spec.bench.machine import blas_library
from mlx_spec.dflash import load_dflash
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loading import default_target_path
from mlx_spec.precision import upcasting
from mlx_spec.sampling import SamplingConfig
from . import RESULTS_DIR
from .mtp_speed import held_out_prompts

KS = (3, 7, 15)


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dflash", default=None, help="the DFlash drafter's directory")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--out", default="dflash-shipped-acceptance")
    return ap.parse_args()


def run(prompt, target, draft, k, tokens, temp=0.0):
    start, rounds = None, []
    mx.random.seed(0)
    for round_ in speculative_generate_step(prompt, target, draft, max_tokens=tokens,
                                            num_draft_tokens=k if draft is not None else None,
                                            prompt_lookup=False,
                                            sampling=SamplingConfig(temp=temp),
                                            calibration=None):
        if start is None:  # the first round carries the prefill
            mx.synchronize()
            start = time.perf_counter()
        rounds.append(round_)
    seconds = time.perf_counter() - start
    speculative = [r for r in rounds if r.num_drafted > 0]
    return {"rounds": len(speculative), "accepted": sum(r.num_accepted for r in speculative),
            "tokens": sum(len(r.tokens) for r in rounds[1:]), "seconds": seconds}


def main():
    args = arguments()
    target, draft_model, tokenizer = load_default_pair()
    dflash_dir = args.dflash or default_target_path().parent / "dflash"
    sources = {"draft model": draft_model, "MTP head": "mtp", "DFlash": load_dflash(dflash_dir)}
    prompts = held_out_prompts(default_target_path() / "tokenizer.json", args.prompts)
    for source in sources.values():  # warm up every path once
        run(prompts[0], target, source, 3, 8)
    configs = [("plain", None, 0)] + [(name, source, k) for k in (*KS, None)
                                      for name, source in sources.items()]
    totals = {(name, k): [] for name, _, k in configs}
    for i, prompt in enumerate(prompts):
        for name, source, k in configs:
            totals[(name, k)].append(run(prompt, target, source, k, args.tokens, args.temp))
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)
    plain = totals[("plain", 0)]
    rows = []
    for (name, k), runs in totals.items():
        rounds = sum(r["rounds"] for r in runs)
        accepted = sum(r["accepted"] for r in runs)
        rows.append({"source": name, "k": "auto" if k is None else k,
                     "block": "auto" if k is None else k + 1, "rounds": rounds,
                     "mean_accepted": round(accepted / rounds, 3) if rounds else 0.0,
                     "tokens_per_round": round(1 + accepted / rounds, 3) if rounds else 1.0,
                     "tokens_per_second": round(statistics.median(
                         r["tokens"] / r["seconds"] for r in runs), 1),
                     "vs_plain": round(statistics.median(
                         (r["tokens"] / r["seconds"]) / (p["tokens"] / p["seconds"])
                         for r, p in zip(runs, plain)), 3)})
    drafter_flag = f"--dflash {args.dflash} " if args.dflash else ""
    native = "" if upcasting() else "MLX_SPEC_DRAFT_DTYPE=native "  # drafters in their dtype
    result = {"command": native + "python -m bench.studies.dflash_acceptance " +
                         drafter_flag +
                         f"--prompts {args.prompts} --tokens {args.tokens} --temp {args.temp} "
                         f"--out {args.out}",
              "drafter": str(dflash_dir),
              "machine": platform.processor() or platform.machine(), "blas": blas_library(),
              "mlx": mx.__version__, "prompts": len(prompts), "tokens": args.tokens,
              "temp": args.temp,
              "rows": rows}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# DFlash drafter: accepted length at equal verify length\n",
             f"`{result['command']}`  \n{result['machine']}, BLAS {result['blas']}, MLX "
             f"{result['mlx']}; temperature {args.temp}, no prompt lookup, no calibration, "
             f"{len(prompts)} held-out prompts x {args.tokens} tokens, all rows interleaved.\n",
             "| source | block (k + 1) | rounds | mean accepted drafts | tokens per round | "
             "tokens/s (median over prompts) | vs plain (median ratio) |",
             "|---|---|---|---|---|---|---|"]
    order = {k: i for i, k in enumerate((0, *KS, "auto"))}
    for row in sorted(rows, key=lambda r: (order[r["k"]], r["source"])):
        lines.append(f"| {row['source']} | {row['block']} | {row['rounds']} | "
                     f"{row['mean_accepted']} | {row['tokens_per_round']} | "
                     f"{row['tokens_per_second']} | {row['vs_plain']} |")
    (RESULTS_DIR / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
