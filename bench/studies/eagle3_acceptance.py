"""Accepted length per round of an EAGLE-3 head trained for the shipped target (training/eagle3.py)
against the shipped draft model, MTP head and DFlash drafter, at k = 2, 4 and 8 drafts, with
each source's speed beside plain decoding.

    python -m bench.studies.eagle3_acceptance [--eagle3 DIR] [--prompts 16] [--tokens 96]
        [--temps 0,0.7] [--ks 2,4,8,auto] [--out NAME]

`--eagle3` names the head's directory (default: mlx_spec/default_models/eagle3 when shipped,
else training/.cache/eagle3/head, where `python -m training.eagle3` writes).

Held-out prompts: the training script's `make_prompts` over the validation modules (the same
as mtp_speed's and dflash_acceptance's). With a fixed k every source drafts exactly k tokens
per round (no prompt lookup, no calibration), so the rounds verify the same number of tokens
and only the proposals differ; "auto" is the default policy (k per source, auto-off; no
prompt lookup). Reported per temperature, source and k: mean accepted drafts per speculative
round (count-based, so machine load cannot move it), tokens per round, and tokens/s of the
generation (prefill excluded) with its median ratio to plain decoding over prompts, every
configuration interleaved prompt by prompt (the order reversed on every other prompt). At
T = 0 every output is checked equal to plain decoding's. Writes bench/results/<NAME>.json and
.md. Run from the repository root.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_spec import load_default_pair
from mlx_spec.dflash import load_dflash
from mlx_spec.eagle3 import load_eagle3
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loading import default_target_path
from mlx_spec.sampling import SamplingConfig
from . import parse_temps, study_header, write_results
from .mtp_speed import held_out_prompts

TRAINED = Path("training") / ".cache" / "eagle3" / "head"


def arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eagle3", default=None, help="the EAGLE-3 head's directory")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--ks", default="2,4,8,auto", help="fixed k's and/or 'auto' (the policy)")
    ap.add_argument("--out", default="eagle3-acceptance")
    args = ap.parse_args(argv)
    args.temps = parse_temps(ap, args.temps)
    try:
        args.ks = [None if k == "auto" else int(k) for k in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks takes whole numbers and 'auto' separated by commas, got {args.ks!r}.")
    return args


def eagle3_directory(given) -> Path:
    if given:
        return Path(given)
    shipped = default_target_path().parent / "eagle3"
    return shipped if shipped.exists() else TRAINED


def run(prompt, target, draft, k, tokens, temp):
    """One generation: its tokens, speculative rounds, accepted drafts and seconds after the
    first round (which carries the prefill)."""
    start, rounds = None, []
    mx.random.seed(0)
    for round_ in speculative_generate_step(prompt, target, draft, max_tokens=tokens,
                                            num_draft_tokens=k if draft is not None else None,
                                            prompt_lookup=False,
                                            sampling=SamplingConfig(temp=temp),
                                            calibration=None):
        if start is None:
            mx.synchronize()
            start = time.perf_counter()
        rounds.append(round_)
    seconds = time.perf_counter() - start
    speculative = [r for r in rounds if r.num_drafted > 0]
    return {"text": [t for r in rounds for t in r.tokens],
            "rounds": len(speculative), "accepted": sum(r.num_accepted for r in speculative),
            "drafted": sum(r.num_drafted for r in speculative),
            "tokens": sum(len(r.tokens) for r in rounds[1:]), "seconds": seconds}


def measure(target, sources, prompts, ks, tokens, temp):
    configs = [("plain", None, 0)] + [(name, source, k) for k in ks
                                      for name, source in sources.items()]
    runs = {(name, k): [] for name, _, k in configs}
    for i, prompt in enumerate(prompts):
        order = configs if i % 2 == 0 else configs[::-1]
        for name, source, k in order:
            runs[(name, k)].append(run(prompt, target, source, k, tokens, temp))
        if temp == 0:
            plain = runs[("plain", 0)][-1]["text"]
            for key, got in runs.items():
                if got[-1]["text"] != plain:
                    raise SystemExit(f"{key} changed the greedy output on prompt {i}")
        print(f"T = {temp}: prompt {i + 1}/{len(prompts)}", flush=True)
    plain = runs[("plain", 0)]
    rows = []
    for (name, k), got in runs.items():
        rounds = sum(r["rounds"] for r in got)
        accepted = sum(r["accepted"] for r in got)
        drafted = sum(r["drafted"] for r in got)
        rows.append({"temp": temp, "source": name, "k": "auto" if k is None else k,
                     "rounds": rounds, "drafted": drafted,
                     "mean_accepted": round(accepted / rounds, 3) if rounds else 0.0,
                     "tokens_per_round": round(1 + accepted / rounds, 3) if rounds else 1.0,
                     "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                     "tokens_per_second": round(statistics.median(
                         r["tokens"] / r["seconds"] for r in got), 1),
                     "vs_plain": round(statistics.median(
                         (r["tokens"] / r["seconds"]) / (p["tokens"] / p["seconds"])
                         for r, p in zip(got, plain)), 3)})
    return rows


def render(header, rows, ks) -> str:
    lines = ["# EAGLE-3 head trained for the shipped target: accepted length per round\n",
             f"`{header['command']}`  \n{header['machine']}; head `{header['eagle3']}`; "
             f"{header['prompts']} held-out prompts x {header['tokens']} tokens, no prompt "
             "lookup, no calibration, every configuration interleaved prompt by prompt. Mean "
             "accepted = accepted drafts per speculative round (count-based); tokens/s and the "
             "ratio to plain are medians over prompts on a shared machine (noisy).\n"]
    order = {k: i for i, k in enumerate([0] + ["auto" if k is None else k for k in ks])}
    for temp in sorted({r["temp"] for r in rows}):
        lines += [f"## T = {temp:g}\n",
                  "| source | k | rounds | mean accepted | tokens per round | acceptance rate "
                  "| tokens/s | vs plain |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["temp"] == temp),
                        key=lambda r: (order[r["k"]], r["source"])):
            rate = "-" if r["acceptance_rate"] is None else r["acceptance_rate"]
            lines.append(f"| {r['source']} | {r['k'] if r['k'] else '-'} | {r['rounds']} | "
                         f"{r['mean_accepted']} | {r['tokens_per_round']} | {rate} | "
                         f"{r['tokens_per_second']} | {r['vs_plain']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    args = arguments(argv)
    target, draft_model, _ = load_default_pair()
    directory = eagle3_directory(args.eagle3)
    sources = {"draft model": draft_model, "MTP head": "mtp",
               "DFlash": load_dflash(default_target_path().parent / "dflash"),
               "EAGLE-3": load_eagle3(directory)}
    prompts = held_out_prompts(default_target_path() / "tokenizer.json", args.prompts)
    for source in sources.values():  # warm up every path once
        run(prompts[0], target, source, 3, 8, 0.0)
    rows = []
    for temp in args.temps:
        rows += measure(target, sources, prompts, args.ks, args.tokens, temp)
    header = study_header("eagle3_acceptance", argv, eagle3=str(directory),
                          prompts=len(prompts), tokens=args.tokens, temps=args.temps)
    write_results(args.out, header, rows, render(header, rows, args.ks))


if __name__ == "__main__":
    main()
