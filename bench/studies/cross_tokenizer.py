"""A draft of another tokenizer: SmolLM2-135M drafting for Gemma-3-270M. What does it buy?

    python -m bench.studies.cross_tokenizer --out cross-tokenizer
    python -m bench.studies.cross_tokenizer --tokens 8 --repeats 1 --prompts 1   # a smoke run

The real pair (`make real-models`: the GGUF files in $MLX_SPEC_REAL_MODELS or
~/.cache/mlx-spec/real-models): Gemma 3's 262,144-token SentencePiece vocabulary, SmolLM2's
49,152-token byte-level BPE. For each temperature (--temps, default 0 and 0.7) and each chat
prompt, interleaved within every repeat (mlx_spec.bench.endtoend.interleave): the target
alone, prompt lookup alone, the draft at a fixed k with each crossing rule pinned
("string", "intersection") and with the per-round choice ("auto"), and mlx-spec's defaults
with the draft (adaptive k, lookup in front as the defaults put it). Every method generates
--tokens tokens from the same prompt; the time is the whole call's (prefill included: the
prompts are short) and the median over repeats is compared with the target alone's.
Reported per method: tokens/s, speed-up, tokens per verify round, acceptance, and the
rounds / drafted / accepted of each crossing rule. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from . import constants, parse_temps, study_header, write_results

TARGET_FILE = "gemma-3-270m-q4_k_m.gguf"
DRAFT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Open-ended questions (no text to copy): what a draft model is for.
QUESTIONS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "What are three good habits for writing readable code?",
    "Describe how a bicycle works.",
]


def real_model(name: str) -> Path:
    root = Path(os.environ.get("MLX_SPEC_REAL_MODELS") or "~/.cache/mlx-spec/real-models")
    path = root.expanduser() / name
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `make real-models` first.")
    return path


def gemma_chat(question: str) -> str:
    """Gemma 3's chat turn (its GGUF file holds no chat template)."""
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


def run(target, draft, ids, temp, tokens, k, rule=None, lookup=False, stats=None):
    """One generation; returns the endtoend RunResult and adds its rounds to `stats`."""
    from mlx_spec.bench.endtoend import RunResult
    from mlx_spec.drafters import cross_tokenizer
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.sampling import SamplingConfig

    start, n, drafted, accepted, rounds = time.perf_counter(), 0, 0, 0, 0
    with constants(cross_tokenizer, DEFAULT_RULE=rule or "auto"):
        for round_ in speculative_generate_step(
                ids, target, draft, max_tokens=tokens, num_draft_tokens=k,
                adaptive=None if k is None else False, sampling=SamplingConfig(temp=temp),
                prompt_lookup=lookup, calibration=None):
            n += len(round_.tokens)
            drafted, accepted = drafted + round_.num_drafted, accepted + round_.num_accepted
            rounds += bool(round_.num_drafted)
            if stats is not None and round_.cross_rule is not None:
                counts = stats.setdefault(round_.cross_rule, [0, 0, 0])
                for i, value in enumerate((1, round_.num_drafted, round_.num_accepted)):
                    counts[i] += value
            if stats is not None:
                stats["rounds"] = stats.get("rounds", 0) + bool(round_.num_drafted)
    return RunResult(time.perf_counter() - start, min(n, tokens), drafted, accepted)


def measure(target, draft, prompts, temp, tokens, k, repeats, warmup, seed, say):
    from mlx_spec.bench.endtoend import interleave
    from mlx_spec.bench.timing import ratio

    stats = {}
    methods = {
        "target alone": lambda ids: run(target, None, ids, temp, tokens, None),
        "lookup alone": lambda ids: run(target, None, ids, temp, tokens, None, lookup=True,
                                        stats=stats.setdefault("lookup alone", {})),
    }
    for rule in ("string", "intersection", "auto"):
        name = f"draft k={k} {rule}"
        methods[name] = (lambda ids, rule=rule, name=name: run(
            target, draft, ids, temp, tokens, k, rule, stats=stats.setdefault(name, {})))
    methods["mlx-spec defaults"] = lambda ids: run(
        target, draft, ids, temp, tokens, None, lookup=None,
        stats=stats.setdefault("mlx-spec defaults", {}))
    results = interleave(methods, prompts, repeats, warmup, seed, say)
    base = results["target alone"].tokens_per_s
    rows = []
    for name, result in results.items():
        counts = stats.get(name, {})
        rules = {r: counts[r] for r in ("string", "intersection") if r in counts}
        drafted = sum(d for _, d, _ in rules.values())
        accepted = sum(a for _, _, a in rules.values())
        rounds = counts.get("rounds", 0)
        rows.append({
            "temp": temp, "method": name, "tokens_per_s": round(result.tokens_per_s, 3),
            "runs_tokens_per_s": [round(v, 3) for v in result.runs_tokens_per_s],
            "speedup": round(ratio(result.tokens_per_s, base), 3),
            "acceptance": None if result.acceptance_rate is None
            else round(result.acceptance_rate, 3),
            "rounds_all_runs": rounds,
            "by_rule": {r: {"rounds": c[0], "drafted": c[1], "accepted": c[2]}
                        for r, c in rules.items()},
            "cross_acceptance": round(accepted / drafted, 3) if drafted else None,
        })
    return rows


def markdown(header, rows) -> str:
    lines = ["# A draft of another tokenizer: SmolLM2-135M for Gemma-3-270M\n",
             f"Command: `{header['command']}`  ", f"Machine: {header['machine']}  ",
             f"Vocabulary overlap: {header['overlap']:.1%} of Gemma's tokens have a SmolLM2 "
             f"twin ({header['shared']} tokens); {header['tokens']} tokens a call, "
             f"{header['repeats']} repeats over {header['prompts']} prompts; weights "
             f"{'dequantized to float32' if header.get('dequantized') else 'as loaded'}\n",
             "| T | method | tokens/s | x target | acceptance | string: rounds, kept/drafted | "
             "intersection: rounds, kept/drafted |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for rule in ("string", "intersection"):
            c = r["by_rule"].get(rule)
            cells.append(f"{c['rounds']}, {c['accepted']}/{c['drafted']}" if c else "-")
        acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        lines.append(f"| {r['temp']} | {r['method']} | {r['tokens_per_s']:.2f} | "
                     f"{r['speedup']:.2f} | {acceptance} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temps", default="0,0.7", help="comma-separated temperatures")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated a call")
    parser.add_argument("--k", type=int, default=4, help="k of the pinned-rule methods")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS),
                        help=f"how many of the {len(QUESTIONS)} questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write bench/results/OUT.json and .md")
    parser.add_argument("--dequantize", action="store_true",
                        help="load both files dequantized to float32 (products through the BLAS)")
    args = parser.parse_args(argv)
    temps = parse_temps(parser, args.temps)
    if min(args.tokens, args.k, args.repeats, args.prompts) < 1 or args.warmup < 0:
        parser.error("--tokens, --k, --repeats and --prompts must be >= 1, --warmup >= 0.")

    from mlx_spec import load
    from mlx_spec.assemble import draft_bridge

    started = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    weights = {"dequantize": True, "dtype": "float32"} if args.dequantize else {}
    target, target_tokenizer = load(str(real_model(TARGET_FILE)), **weights)
    draft, _ = load(str(real_model(DRAFT_FILE)), **weights)
    bridge = draft_bridge(target, draft)
    prompts = [(f"q{i}", target_tokenizer.encode(gemma_chat(q)))
               for i, q in enumerate(QUESTIONS[:args.prompts])]
    rows = []
    for temp in temps:
        say(f"T = {temp}")
        rows += measure(target, draft, prompts, temp, args.tokens, args.k, args.repeats,
                        args.warmup, args.seed, say)
    header = study_header("cross_tokenizer", argv, overlap=bridge.overlap, shared=bridge.shared,
                          tokens=args.tokens, repeats=args.repeats, prompts=args.prompts,
                          dequantized=args.dequantize)
    text = markdown(header, rows)
    if args.out:
        write_results(args.out, header, rows, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
