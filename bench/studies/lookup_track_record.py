"""Does sizing prompt-lookup proposals by the match's track record pay on a copy with edits?

Run from the repository root:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        OPENBLAS_NUM_THREADS=1 python -m bench.studies.lookup_track_record

Writes bench/results/lookup-track-record-<blas>[-<pair>].json and .md (--out another stem).

The copy task: a prompt holding the target's own answer with small edits (one
token in every EDIT_EVERY replaced), then the opening again, so that the
target's greedy answer re-emits the prompt's text with those edits. The answer
depends on the prompt, so the prompt is rebuilt from the latest answer until
the answer stops changing (a fixed point; the agreement is reported). Five
methods, interleaved repeat by repeat on one pair at T = 0 (the shipped float16
pair unless --pair names another of the zoo): plain decoding; prompt lookup alone with every proposal as long as the policy's
k ("lookup, k only": `PromptLookupDrafter.track_record = False`, the behaviour
before) and sized by the track record (the default); the defaults (the draft
model with lookup in front, no calibration) in both ways. mlx-spec is timed
after its prefill, plain from a prefilled cache (as never_behind).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import List

import mlx.core as mx
from mlx_lm.generate import generate_step as mlx_lm_generate_step

from mlx_spec.drafters import PromptLookupDrafter
from mlx_spec.bench.endtoend import interleave, run_target_alone
from mlx_spec.bench.machine import machine_info
from mlx_spec.bench.prompts import PROMPTS
from mlx_spec.bench.timing import ratio
from ..zoo import build_zoo
from . import RESULTS_DIR
from .never_behind import blas_slug, paired_ratio, run_defaults

PLAIN, LOOKUP_K, LOOKUP_TRACK = "plain", "lookup, k only", "lookup, track record"
DEFAULTS_K, DEFAULTS_TRACK = "defaults, k only", "defaults, track record"
DEFAULT_OPENINGS = ("parse_args", "story", "explain", "class_init", "rename")
EDIT_EVERY = 24  # one token in this many of the copied answer is replaced
FIXED_POINT_ITERATIONS = 4
DEFAULT_PAIR = "shipped-f16"  # of bench.zoo; shipped-f32's products go through the BLAS


def greedy(target_model, ids: List[int], max_tokens: int) -> List[int]:
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(ids, mx.uint32), target_model,
                                                     max_tokens=max_tokens)]


def edited(tokens: List[int], vocab_size: int, every: int = EDIT_EVERY) -> List[int]:
    """One token in `every` replaced by another (a small, deterministic edit)."""
    out = list(tokens)
    for i in range(every // 2, len(out), every):
        out[i] = (out[i] * 7 + 13) % vocab_size
    return out


def copy_with_edits_prompt(pair, opening: List[int], max_tokens: int):
    """(prompt, agreement): opening + edited answer + blank line + opening, rebuilt until the
    answer it leads to stops changing; agreement = tokens of the last answer equal to the one
    before (max_tokens at a fixed point)."""
    blank = list(pair.tokenizer.encode("\n\n", add_special_tokens=False))
    vocab = pair.tokenizer.vocab_size
    answer = greedy(pair.target_model, opening, max_tokens)
    for _ in range(FIXED_POINT_ITERATIONS):
        prompt = opening + edited(answer, vocab) + blank + opening
        previous, answer = answer, greedy(pair.target_model, prompt, max_tokens)
        if answer == previous:
            break
    return prompt, sum(a == b for a, b in zip(answer, previous))


def lookup(pair, ids, max_tokens, track_record: bool, log: list, draft_model=None):
    PromptLookupDrafter.track_record = track_record
    try:
        return run_defaults(pair.target_model, draft_model, ids, 0.0, max_tokens, log,
                            prompt_lookup=True, calibration=None)
    finally:
        PromptLookupDrafter.track_record = True


def measure(openings=DEFAULT_OPENINGS, max_tokens: int = 128, repeats: int = 3, warmup: int = 1,
            pair_name: str = DEFAULT_PAIR, progress=None) -> dict:
    start = time.perf_counter()
    pair = build_zoo([pair_name])[0]
    by_name = {p.name: p for p in PROMPTS}
    prompts, agreement = [], {}
    for name in openings:
        ids, agreement[name] = copy_with_edits_prompt(
            pair, list(pair.tokenizer.encode(by_name[name].text)), max_tokens)
        prompts.append((by_name[name], ids))
    logs = {LOOKUP_K: [], LOOKUP_TRACK: [], DEFAULTS_K: [], DEFAULTS_TRACK: []}
    draft = pair.draft_model
    methods = {
        PLAIN: lambda ids: run_target_alone(pair.target_model, ids, 0.0, max_tokens),
        LOOKUP_K: lambda ids: lookup(pair, ids, max_tokens, False, logs[LOOKUP_K]),
        LOOKUP_TRACK: lambda ids: lookup(pair, ids, max_tokens, True, logs[LOOKUP_TRACK]),
        DEFAULTS_K: lambda ids: lookup(pair, ids, max_tokens, False, logs[DEFAULTS_K], draft),
        DEFAULTS_TRACK: lambda ids: lookup(pair, ids, max_tokens, True, logs[DEFAULTS_TRACK],
                                           draft),
    }
    # Every opening `repeats` times, cycling through them (interleave's prompt order).
    results = interleave(methods, prompts, repeats=repeats * len(prompts),
                         warmup=warmup * len(prompts), progress=progress)
    per_round = {name: ratio(sum(t for t, _ in log[warmup * len(prompts):]),
                             sum(r for _, r in log[warmup * len(prompts):]))
                 for name, log in logs.items()}
    ratios = {f"{a} / {b}": dataclasses.asdict(paired_ratio(results[a], results[b]))
              for a, b in ((LOOKUP_K, PLAIN), (LOOKUP_TRACK, PLAIN), (LOOKUP_TRACK, LOOKUP_K),
                           (DEFAULTS_K, PLAIN), (DEFAULTS_TRACK, PLAIN),
                           (DEFAULTS_TRACK, DEFAULTS_K))}
    machine = machine_info()
    return {"machine": dataclasses.asdict(machine), "blas": blas_slug(machine.blas),
            "pair": pair_name,
            "max_tokens": max_tokens, "repeats_per_opening": repeats, "warmup": warmup,
            "edit_every": EDIT_EVERY, "fixed_point_agreement": agreement,
            "methods": {n: dataclasses.asdict(r) for n, r in results.items()},
            "tokens_per_round": per_round, "ratios": ratios,
            "seconds": time.perf_counter() - start}


def render(result: dict, command: str) -> str:
    out = ["# Prompt lookup sized by the match's track record: copy task with edits", "",
           f"Command: `{command}`", "",
           f"BLAS: {result['blas']}; pair {result.get('pair', DEFAULT_PAIR)}, T = 0, {result['max_tokens']} tokens; "
           f"openings {', '.join(result['fixed_point_agreement'])}, each "
           f"{result['repeats_per_opening']} times after {result['warmup']} warm-up, methods "
           f"interleaved; one token in {result['edit_every']} of the copied answer edited.", "",
           "| method | median tok/s | tokens per round |", "|---|---|---|"]
    for name, r in result["methods"].items():
        tpr = result["tokens_per_round"].get(name)
        out.append(f"| {name} | {r['tokens_per_s']:.1f} | {f'{tpr:.2f}' if tpr else '1'} |")
    out += ["", "| ratio (median of per-repeat ratios) | value | interval |", "|---|---|---|"]
    for name, r in result["ratios"].items():
        out.append(f"| {name} | {r['value']:.2f}x | {r['low']:.2f}-{r['high']:.2f} "
                   f"({r['coverage']:.0%}) |")
    agreement = ", ".join(f"{k} {v}/{result['max_tokens']}"
                          for k, v in result["fixed_point_agreement"].items())
    out += ["", f"Fixed-point agreement of the answers (tokens equal to the previous "
            f"iteration's): {agreement}.", "", f"Took {result['seconds']:.0f} s."]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per opening")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pair", default=DEFAULT_PAIR, help="a pair of bench.zoo")
    parser.add_argument("--out", help="path stem of the .json and .md to write")
    args = parser.parse_args(argv)
    result = measure(max_tokens=args.max_tokens, repeats=args.repeats, pair_name=args.pair,
                     progress=lambda message: print(message, file=sys.stderr, flush=True))
    suffix = "" if args.pair == DEFAULT_PAIR else f"-{args.pair}"
    stem = args.out or str(RESULTS_DIR / f"lookup-track-record-{result['blas']}{suffix}")
    environment = " ".join(f"{name}={os.environ[name]}" for name in
                           ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") if name in os.environ)
    command = f"{environment} python -m bench.studies.lookup_track_record " + " ".join(
        argv if argv is not None else sys.argv[1:])
    with open(f"{stem}.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(f"{stem}.md", "w") as f:
        f.write(render(result, command.strip()))
    print(render(result, command.strip()))


if __name__ == "__main__":
    main()
