"""End-to-end speed of the shipped target's MTP head against the draft model, interleaved.

    python -m bench.studies.mtp_speed [--prompts 12] [--tokens 96] [--repeats 2] [--out NAME]

On the held-out prompts the acceptance was simulated on (the training script's
`make_prompts` over the validation modules, same seed), each prompt is
generated greedily by every configuration in turn (target alone, draft model,
MTP head, and prompt lookup in front of each; adaptive k and fixed k), so
machine noise hits all of them alike. Reported: median tokens/s (prompt
prefill included) and the median over prompts of each configuration's speed
divided by the target alone's on that same prompt, plus acceptance from the
rounds. Run from the repository root (the prompts come from training/data.py):
writes bench/results/<out>.json and .md. Torch is not needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_spec
from mlx_spec.generate import speculative_generate_step
from . import RESULTS_DIR

SEED = 1234  # the training script's: the same held-out prompts as metrics.json
PROMPT_TOKENS = 64


def held_out_prompts(tokenizer_path: Path, n: int):
    from tokenizers import Tokenizer
    from training.data import encode_stream, load_corpus, make_prompts  # the repository's

    tok = Tokenizer.from_file(str(tokenizer_path))
    _, _, val = load_corpus()
    val_ids = encode_stream(tok, [t for _, t in val], 0)
    return [p.tolist() for p in make_prompts(val_ids, 32, PROMPT_TOKENS, SEED, 0, 64)[:n]]


def configurations(draft):
    out = {"target alone": dict(draft_model=None, prompt_lookup=False)}
    for name, source in (("draft model", draft), ("MTP head", "mtp")):
        out[name] = dict(draft_model=source, prompt_lookup=False)
        out[f"lookup + {name}"] = dict(draft_model=source, prompt_lookup=True)
        out[f"{name}, k=2"] = dict(draft_model=source, prompt_lookup=False, num_draft_tokens=2)
        out[f"{name}, k=4"] = dict(draft_model=source, prompt_lookup=False, num_draft_tokens=4)
    return out


def run_once(target, prompt, tokens, kwargs):
    start = time.perf_counter()
    out, drafted, accepted, rounds = [], 0, 0, 0
    for r in speculative_generate_step(prompt, target, max_tokens=tokens, calibration=None, **kwargs):
        out += r.tokens
        drafted += r.num_drafted
        accepted += r.num_accepted
        rounds += 1
    seconds = time.perf_counter() - start
    return out, len(out) / seconds, drafted, accepted


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="mtp-shipped")
    args = ap.parse_args(argv)
    target, draft, _ = mlx_spec.load_default_pair()
    from mlx_spec.default_models import DEFAULT_TARGET_PATH

    prompts = held_out_prompts(DEFAULT_TARGET_PATH / "tokenizer.json", args.prompts)
    configs = configurations(draft)
    for kwargs in configs.values():  # warm up every path (and load the MTP head once)
        run_once(target, prompts[0], 16, kwargs)
    speed = {name: [] for name in configs}
    ratio = {name: [] for name in configs}
    drafted = {name: 0 for name in configs}
    accepted = {name: 0 for name in configs}
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            names = list(configs) if (i + rep) % 2 == 0 else list(configs)[::-1]  # alternate the order
            got = {}
            for name in names:
                tokens, tps, d, a = run_once(target, prompt, args.tokens, configs[name])
                got[name] = (tokens, tps)
                speed[name].append(tps)
                drafted[name] += d
                accepted[name] += a
            reference = got["target alone"][0]
            for name in names:
                assert got[name][0] == reference, f"{name} changed the greedy output"
                ratio[name].append(got[name][1] / got["target alone"][1])
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    blas = "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference (netlib)"
    rows = {name: {"median_tokens_per_s": round(statistics.median(speed[name]), 1),
                   "median_speedup_vs_target": round(statistics.median(ratio[name]), 3),
                   "speedup_quartiles": [round(float(q), 3) for q in np.percentile(ratio[name], [25, 75])],
                   "acceptance_rate": round(accepted[name] / drafted[name], 3) if drafted[name] else None,
                   "drafted": drafted[name]}
            for name in configs}
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "blas": blas,
              "mlx": mx.__version__, "dtype": "float16 (shipped weights: MLX's CPU matmul does not call BLAS "
              "for float16)", "prompts": len(prompts), "tokens": args.tokens, "repeats": args.repeats,
              "greedy": True, "rows": rows}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Shipped target: MTP head vs draft model ({blas})", "",
             f"{result['machine']}, MLX {result['mlx']}, {result['dtype']}. Greedy, {len(prompts)} held-out "
             f"prompts of {PROMPT_TOKENS} tokens x {args.repeats} repeats, {args.tokens} tokens each, "
             "configurations interleaved per prompt (order alternating); every output checked equal to "
             "the target's. Speedup: median over runs of (tokens/s) / (target alone's tokens/s on the "
             "same prompt, same repeat); adaptive k unless a k is given; `python -m bench.studies.mtp_speed`.", "",
             "| configuration | median tokens/s | speedup vs target (median, IQR) | acceptance |",
             "|---|---|---|---|"]
    for name, r in rows.items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        q = r["speedup_quartiles"]
        lines.append(f"| {name} | {r['median_tokens_per_s']} | {r['median_speedup_vs_target']:.2f}x "
                     f"({q[0]:.2f}-{q[1]:.2f}) | {acc} |")
    (RESULTS_DIR / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
