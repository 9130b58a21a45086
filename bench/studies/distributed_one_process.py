"""The single-process baseline for `mlx-spec bench --distributed`: the same figures, target whole.

    python -m bench.studies.distributed_one_process [--json PATH]

Runs the end-to-end and verify-cost measurements of mlx_spec/bench/distributed.py
on the shipped pair in this one process (no launch, no collectives), so the
sharded figures can be read against them. Run from the repository root: writes
bench/results/linux-x86-netlib-distributed-one-process.json unless --json says
where.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx_spec
from mlx_spec.bench.distributed import DEFAULT_MAX_TOKENS, generation_tps, verify_seconds
from mlx_spec.bench.prompts import QUICK_PROMPTS
from mlx_spec.loading import default_draft_path, default_target_path
from . import RESULTS_DIR


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(RESULTS_DIR / "linux-x86-netlib-distributed-one-process.json"))
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = parser.parse_args()
    target, tokenizer = mlx_spec.load(str(default_target_path()))
    draft, _ = mlx_spec.load(str(default_draft_path()))
    prompts = [tokenizer.encode(p.text) for p in QUICK_PROMPTS]
    generation_tps(target, draft, prompts[0], 8)  # warm-up
    result = {"plain_tps": [], "speculative_tps": [], "tokens_per_round": []}
    for prompt in prompts:
        result["plain_tps"].append(generation_tps(target, None, prompt, args.max_tokens)[0])
        tps, per_round = generation_tps(target, draft, prompt, args.max_tokens)
        result["speculative_tps"].append(tps)
        result["tokens_per_round"].append(per_round)
    result["verify_seconds"] = verify_seconds(target)
    result["speedup"] = (statistics.median(result["speculative_tps"])
                         / statistics.median(result["plain_tps"]))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
