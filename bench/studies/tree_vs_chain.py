"""Token trees against chains against plain decoding, on one machine, at fixed shapes.

    python -m bench.studies.tree_vs_chain [--pairs shipped-f32] [--temps 0,0.7]
        [--chains 2,3,4,6] [--trees 2x2,3x2,4x2,2x3,3x3] [--tokens 64] [--repeats 5]
        [--out NAME]

For each pair and temperature, interleaved over the code prompts (the order
reversing every other repeat): plain decoding (mlx-lm's generate_step), the
draft model alone as a chain at each fixed k (`num_draft_tokens=k`, no prompt
lookup), the draft model proposing token trees of each fixed DxW shape (a spine
of D drafts with W - 1 sibling leaves beside each spine node: D x W nodes
verified in one pass; `tree=(D, W)`), and mlx-spec's defaults (the policy's
choice). Every run is timed from the end of the target's prefill to its last
token. Reported: tokens per second (median over repeats), each method over
plain and over the best chain (median of the per-repeat ratios, 90% interval),
the tokens a verify pass emitted and the share of passes that verified a tree.
Writes bench/results/<NAME>.{json,md} (default tree-vs-chain).

`--predict-macs` writes no timing: a roofline MODEL PREDICTION (not a
measurement) for Apple M-series GPUs with dflash_cost's chips and Qwen3-8B
at MLX 4-bit as the target, Qwen3-0.6B at 4-bit as the draft: a pass over n
tokens takes max(bytes / bandwidth, 2 x parameters x n / peak flops); the best
chain and the best tree (up to 8 x 3) by the policy's own formula, E(k, w) over
k draft steps plus a pass over 1 + k w tokens, at per-draft acceptance
--mac-acceptance and one sibling's chance --mac-sibling.

Read before the runs: a fixed tree pays where its ÷ best chain interval lies
wholly above 1.0; the defaults choose well where they run tree rounds only
where some tree pays and stay within 0.9 of the best fixed method otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List

from mlx_spec.bench.endtoend import interleave, run_target_alone
from mlx_spec.bench.prompts import encode_prompts
from mlx_spec.bench.timing import DEFAULT_WARMUP, ratio
from mlx_spec.costmodel import expected_tree_tokens
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig
from ..zoo import PAIR_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .copy_ceiling import timed_from_prefill
from .never_behind import paired_ratio

PLAIN, DEFAULTS = "plain", "defaults"


def chain(k: int) -> str:
    return f"chain k={k}"


def tree(shape) -> str:
    return f"tree {shape[0]}x{shape[1]}"


def run(target_model, draft_model, ids, temp: float, tokens: int, log: list, trees: list,
        **options):
    """One timed call; `trees` gets how many of its rounds verified a token tree."""
    def rounds(progress):
        count = 0
        for round_ in speculative_generate_step(
                ids, target_model, draft_model, max_tokens=tokens,
                sampling=SamplingConfig(temp=temp), prompt_progress_callback=progress, **options):
            count += round_.tree_nodes > 0
            yield round_
        trees.append(count)
    return timed_from_prefill(rounds, log, [])


def measure(pair, temp: float, chains: List[int], trees: List[tuple], tokens: int,
            repeats: int) -> dict:
    target, draft = pair.target_model, pair.draft_model
    prompts = encode_prompts(pair.tokenizer)
    logs: Dict[str, list] = {}
    tree_rounds: Dict[str, list] = {}
    methods = {PLAIN: lambda ids: run_target_alone(target, ids, temp, tokens)}

    def method(name, **options):
        logs[name], tree_rounds[name] = [], []
        methods[name] = lambda ids: run(target, draft, ids, temp, tokens, logs[name],
                                        tree_rounds[name], **options, **pair.draft_options)

    for k in chains:
        method(chain(k), num_draft_tokens=k, tree=False, prompt_lookup=False)
    for shape in trees:
        method(tree(shape), num_draft_tokens=shape[0], tree=shape, prompt_lookup=False)
    method(DEFAULTS)
    results = interleave(methods, prompts, repeats=repeats,
                         progress=lambda line: print(f"  {pair.name} T={temp}: {line}",
                                                     file=sys.stderr, flush=True))
    best_chain = max(map(chain, chains), key=lambda name: results[name].tokens_per_s)
    row = {"pair": pair.name, "temp": temp, "best_chain": best_chain,
           "tokens_per_s": {name: r.tokens_per_s for name, r in results.items()},
           "over_plain": {}, "over_best_chain": {}, "tokens_per_pass": {},
           "tree_round_share": {}}
    for name in methods:
        if name != PLAIN:
            r = paired_ratio(results[name], results[PLAIN])
            row["over_plain"][name] = None if r is None else [r.value, r.low, r.high]
            r = paired_ratio(results[name], results[best_chain])
            row["over_best_chain"][name] = None if r is None else [r.value, r.low, r.high]
        timed = logs.get(name, [])[DEFAULT_WARMUP:]
        if timed:
            row["tokens_per_pass"][name] = ratio(sum(t for t, _, _ in timed),
                                                 sum(n for _, n, _ in timed))
            row["tree_round_share"][name] = ratio(sum(tree_rounds[name][DEFAULT_WARMUP:]),
                                                  sum(n for _, n, _ in timed))
    return row


def render(rows: List[dict], header: dict) -> str:
    out = ["# Token trees against chains", "", f"`{header['command']}`  ",
           f"{header['machine']}; the code prompts, {header['tokens']} tokens, "
           f"{header['repeats']} repeats after a warm-up, interleaved; the draft model alone "
           "(no prompt lookup) for chains and trees, the defaults as shipped. Each method: "
           "tokens/s (median), ÷ plain and ÷ the best chain of the row (median of the per-repeat "
           "ratios, 90% interval), tokens per verify pass (plain steps included), and the share "
           "of passes that verified a tree.", ""]
    for row in rows:
        out += [f"## {row['pair']}, T = {row['temp']}: best chain {row['best_chain']}", "",
                "| method | tok/s | ÷ plain | ÷ best chain | tokens a pass | tree rounds |",
                "|---|---:|---|---|---:|---:|"]
        for name, tps in row["tokens_per_s"].items():
            def cell(r):
                return "-" if r is None else f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})"
            per = row["tokens_per_pass"].get(name)
            share = row["tree_round_share"].get(name)
            out.append(f"| {name} | {tps:.1f} | {cell(row['over_plain'].get(name))} | "
                       f"{cell(row['over_best_chain'].get(name))} | "
                       f"{'-' if per is None else f'{per:.2f}'} | "
                       f"{'-' if share is None else f'{share:.0%}'} |")
        out.append("")
    return "\n".join(out)


QWEN3_06B = {"hidden": 1024, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128,
             "intermediate": 3072, "vocab": 151936}


def _read_parameters(q: dict) -> int:
    """The weights one pass reads: every layer and the output head."""
    h, hd = q["hidden"], q["head_dim"]
    layer = 2 * h * q["heads"] * hd + 2 * h * q["kv_heads"] * hd + 3 * h * q["intermediate"]
    return q["layers"] * layer + q["vocab"] * h


def predict_macs(acceptance: float, sibling: float, context: int = 1024) -> dict:
    """The roofline prediction (see the module docstring): per chip the best chain and tree."""
    from .dflash_cost import CHIPS, MLX_4BIT, QWEN3_8B

    bits = MLX_4BIT / 8
    target, draft = _read_parameters(QWEN3_8B), _read_parameters(QWEN3_06B)
    kv = QWEN3_8B["layers"] * 2 * QWEN3_8B["kv_heads"] * QWEN3_8B["head_dim"] * 2 * context
    chips = []
    for name, gbs, tflops, _ in CHIPS:
        bandwidth, flops = gbs * 1e9, tflops * 1e12

        def target_time(n):
            return max((target * bits + kv) / bandwidth, 2 * target * n / flops)

        step = max(draft * bits / bandwidth, 2 * draft / flops) / target_time(1)
        shapes = {}
        for w in (1, 2, 3):
            rescued = 0.0 if w == 1 else 1.0 - (1.0 - sibling) ** (w - 1)
            for k in range(1, 9):
                cost = k * step + target_time(1 + k * w) / target_time(1)
                shapes[(k, w)] = expected_tree_tokens(acceptance, k, rescued) / cost
        chain = max((s for s in shapes if s[1] == 1), key=shapes.get)
        tree = max((s for s in shapes if s[1] > 1), key=shapes.get)
        chips.append({"chip": name, "draft_step": round(step, 3),
                      "verify_cost_9_17_25": [round(target_time(n) / target_time(1), 2)
                                              for n in (9, 17, 25)],
                      "best_chain": [chain[0], round(shapes[chain], 2)],
                      "best_tree": [f"{tree[0]}x{tree[1]}", round(shapes[tree], 2)]})
    return {"acceptance": acceptance, "sibling": sibling, "context": context, "chips": chips}


def render_macs(models: List[dict], header: dict) -> str:
    first = models[0]
    out = ["# Token trees on Apple M-series: a MODEL PREDICTION, not a measurement", "",
           f"`{header['command']}`  ",
           "A roofline from peak figures (bench/studies/dflash_cost.py's chips): target "
           "Qwen3-8B at MLX 4-bit, draft Qwen3-0.6B at MLX 4-bit, a context of "
           f"{first['context']} tokens; per-draft acceptance {first['acceptance']}; one "
           "sibling's chance beta as given; the policy's formula E(k, w) / (k d + V(1 + k w)) "
           "in target steps, k <= 8, w <= 3.", "",
           "| chip | beta | draft step d | verify cost V(9) / V(17) / V(25) | best chain "
           "(k, speed-up) | best tree (DxW, speed-up) |", "|---|---:|---:|---|---|---|"]
    for model in models:
        for c in model["chips"]:
            out.append(f"| {c['chip']} | {model['sibling']} | {c['draft_step']} | "
                       f"{' / '.join(map(str, c['verify_cost_9_17_25']))} | "
                       f"k = {c['best_chain'][0]}, {c['best_chain'][1]:.2f}x | "
                       f"{c['best_tree'][0]}, {c['best_tree'][1]:.2f}x |")
    return "\n".join(out) + "\n"


def parse_shapes(parser, text: str) -> List[tuple]:
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in text.split(",")]
    except ValueError:
        parser.error(f"--trees must be comma-separated DxW shapes, got {text!r}.")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        parser.error(f"--trees must be DxW with D, W >= 1, got {text!r}.")
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="shipped-f32")
    parser.add_argument("--temps", default="0,0.7")
    parser.add_argument("--chains", default="2,3,4,6")
    parser.add_argument("--trees", default="2x2,3x2,4x2,2x3,3x3")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="tree-vs-chain")
    parser.add_argument("--predict-macs", action="store_true",
                        help="write the M-series model prediction instead of timing")
    parser.add_argument("--mac-acceptance", type=float, default=0.7)
    parser.add_argument("--mac-sibling", default="0.1,0.3,0.5",
                        help="comma-separated chances of one sibling, one table row each")
    args = parser.parse_args(argv)
    if args.predict_macs:
        header = study_header("tree_vs_chain", argv)
        models = [predict_macs(args.mac_acceptance, float(b))
                  for b in args.mac_sibling.split(",")]
        write_results(args.out, header, models, render_macs(models, header))
        return 0
    check_pairs(parser, args.pairs, PAIR_NAMES)
    try:
        temps = [float(t) for t in args.temps.split(",")]
        chains = [int(k) for k in args.chains.split(",")]
    except ValueError:
        parser.error("--temps and --chains must be comma-separated numbers.")
    if args.tokens < 2 or args.repeats < 1 or min(chains) < 1:
        parser.error("--tokens must be >= 2, --repeats >= 1 and every chain k >= 1.")
    trees = parse_shapes(parser, args.trees)
    header = study_header("tree_vs_chain", argv, tokens=args.tokens, repeats=args.repeats)
    rows = []
    for pair in build_zoo(args.pairs.split(",")):
        for temp in temps:
            rows.append(measure(pair, temp, chains, trees, args.tokens, args.repeats))
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
