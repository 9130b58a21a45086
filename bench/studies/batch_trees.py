"""Token trees in a batch against chains and plain batched decoding, at fixed shapes.

    python -m bench.studies.batch_trees [--pairs shipped-f32] [--rows 4] [--k 3]
        [--trees 3x2,3x3] [--tokens 48] [--repeats 3] [--out NAME]

For each pair, greedy, interleaved (the order reversing every other repeat): --rows
rows (the code prompts, one each, in turn) decoded together by the batch engine
plainly (k = 0), with the draft model's chains at k (no prompt lookup), and with its
token trees of each DxW shape (batch/trees.py: each row its own tree, one verify pass
of B x (1 + D W) positions). Each run is timed from the moment every row has joined
(their prompts prefilled) to the last row's last token. Reported: tokens per second
over all rows (median over repeats), each method over plain batched decoding and over
the chain (median of the per-repeat ratios, 90% interval), and the share of rows'
rounds that verified a tree. Writes bench/results/<NAME>.{json,md} (default
batch-trees).

Read before the runs: a tree shape pays in a batch where its ÷ chain interval lies
wholly above 1.0.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.bench.endtoend import RunResult, interleave
from mlx_spec.bench.prompts import encode_prompts
from mlx_spec.bench.timing import DEFAULT_WARMUP
from ..zoo import PAIR_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .never_behind import paired_ratio
from .tree_vs_chain import parse_shapes

PLAIN = "plain batched"


def run_batch(target, draft, prompts: List[List[int]], tokens: int, counts: list,
              **options) -> RunResult:
    """Every prompt one row, `tokens` each; timed from when every row has joined."""
    engine = BatchEngine(target, draft, **options)
    for ids in prompts:
        engine.insert(RowRequest(ids, tokens, prompt_lookup=False))
    emitted, drafted, accepted, trees, rounds = 0, 0, 0, 0, 0
    start = None
    while engine.busy:
        if start is None and not engine.joining:
            start = time.perf_counter()
        for out in engine.step():
            if start is not None:
                emitted += len(out.tokens)
                drafted, accepted = drafted + out.num_drafted, accepted + out.num_accepted
                trees, rounds = trees + bool(out.tree_nodes), rounds + 1
    counts.append((trees, rounds))
    return RunResult(time.perf_counter() - start, emitted, drafted, accepted)


def measure(pair, rows: int, k: int, trees: List[tuple], tokens: int, repeats: int) -> dict:
    target, draft = pair.target_model, pair.draft_model
    encoded = [ids for _, ids in encode_prompts(pair.tokenizer)]
    batches = [(None, [encoded[(r + i) % len(encoded)] for i in range(rows)])
               for r in range(len(encoded))]  # each repeat's rows start one prompt later
    counts: Dict[str, list] = {}

    def method(name, **options):
        counts[name] = []
        return lambda batch: run_batch(target, draft, batch, tokens, counts[name], **options)

    chain = f"chain k={k}"
    methods = {PLAIN: method(PLAIN, num_draft_tokens=0), chain: method(chain, num_draft_tokens=k)}
    for shape in trees:
        name = f"tree {shape[0]}x{shape[1]}"
        methods[name] = method(name, num_draft_tokens=shape[0], tree=shape)
    results = interleave(methods, batches, repeats=repeats,
                         progress=lambda line: print(f"  {pair.name}: {line}", file=sys.stderr,
                                                     flush=True))
    row = {"pair": pair.name, "rows": rows, "tokens_per_s": {}, "over_plain": {},
           "over_chain": {}, "tree_round_share": {}, "acceptance": {}}
    for name, result in results.items():
        row["tokens_per_s"][name] = result.tokens_per_s
        row["acceptance"][name] = result.acceptance_rate
        for key, base in (("over_plain", PLAIN), ("over_chain", chain)):
            r = paired_ratio(result, results[base]) if name != base else None
            row[key][name] = None if r is None else [r.value, r.low, r.high]
        timed = counts[name][DEFAULT_WARMUP:]
        tree_rounds, all_rounds = map(sum, zip(*timed)) if timed else (0, 0)
        row["tree_round_share"][name] = tree_rounds / all_rounds if all_rounds else 0.0
    return row


def render(rows: List[dict], header: dict) -> str:
    lines = ["# Token trees in a batch against chains and plain batched decoding\n",
             f"`{header['command']}`  ", f"{header['machine']}; greedy, {header['tokens']} "
             f"tokens a row, {header['repeats']} repeats after a warm-up, interleaved; timed "
             "from when every row has joined. Ratios: median of the per-repeat ratios (90% "
             "interval).\n"]
    for row in rows:
        lines += [f"## {row['pair']}, {row['rows']} rows\n",
                  "| method | tok/s (all rows) | ÷ plain batched | ÷ chain | acceptance | "
                  "tree rounds |", "|---|---:|---|---|---:|---:|"]

        def cell(r):
            return "-" if r is None else f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})"
        for name, tps in row["tokens_per_s"].items():
            a = row["acceptance"][name]
            lines.append(f"| {name} | {tps:.1f} | {cell(row['over_plain'][name])} | "
                         f"{cell(row['over_chain'][name])} | "
                         f"{'-' if a is None else f'{a:.0%}'} | "
                         f"{row['tree_round_share'][name]:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="shipped-f32")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--k", type=int, default=3, help="the chain's k")
    parser.add_argument("--trees", default="3x2,3x3")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="batch-trees")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, PAIR_NAMES)
    if min(args.rows, args.k, args.repeats) < 1 or args.tokens < 2:
        parser.error("--rows, --k and --repeats must be >= 1, --tokens >= 2.")
    trees = parse_shapes(parser, args.trees)
    header = study_header("batch_trees", argv, tokens=args.tokens, repeats=args.repeats)
    rows = [measure(pair, args.rows, args.k, trees, args.tokens, args.repeats)
            for pair in build_zoo(args.pairs.split(","))]
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
