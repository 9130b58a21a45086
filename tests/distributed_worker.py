"""One rank of the distributed tests, started by `mlx.launch` (see tests/test_distributed.py).

Loads the target sharded and the draft whole, runs the scenarios named on the
command line on token ids, and writes what this rank saw to OUT/rank<r>.json.
"mtp_greedy" drafts with an MTP layer instead (`--mtp-weights`), on the
launch's target or on `--mtp-target`, loaded sharded the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx

PROMPT = [5, 17, 42, 8, 99, 3, 77, 21]


def rounds_of(stream):
    tokens, rounds = [], []
    for round_ in stream:
        tokens += round_.tokens
        rounds.append([round_.source, round_.num_drafted, round_.num_accepted])
    return {"tokens": tokens, "rounds": rounds}


def run(scenario, target, draft, mtp_weights=None):
    from mlx_spec.exactness import check_exactness
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.sampling import SamplingConfig

    greedy, sampled = SamplingConfig(), SamplingConfig(temp=1.0)
    if scenario == "greedy_k3":
        return rounds_of(speculative_generate_step(PROMPT, target, draft, max_tokens=40,
                                                   num_draft_tokens=3, calibration=None))
    if scenario == "greedy_adaptive":  # lookup in front of the draft, k chosen from timings
        stream = speculative_generate_step(PROMPT * 3, target, draft, max_tokens=48,
                                           adaptive=True, calibration=None)
        result = rounds_of(stream)
        result["policy"] = stream.policy.describe()
        return result
    if scenario == "mtp_greedy":  # every rank loads the MTP layer whole and drafts with it
        return rounds_of(speculative_generate_step(PROMPT, target, "mtp", mtp_weights=mtp_weights,
                                                   max_tokens=40, num_draft_tokens=3,
                                                   calibration=None))
    if scenario == "plain":
        return rounds_of(speculative_generate_step(PROMPT, target, None, max_tokens=12))
    if scenario == "sampled_seeded":
        mx.random.seed(7)
        return rounds_of(speculative_generate_step(PROMPT, target, draft, max_tokens=30,
                                                   num_draft_tokens=2, sampling=sampled,
                                                   calibration=None))
    if scenario == "sampled_adaptive":  # unseeded: the ranks' own random streams differ
        mx.random.seed(1000 + mx.distributed.init().rank())
        stream = speculative_generate_step(PROMPT, target, draft, max_tokens=30, adaptive=True,
                                           sampling=sampled, calibration=None)
        return rounds_of(stream)
    if scenario.startswith("chi_square"):
        samples = int(scenario.split(":")[1])
        result = check_exactness(target, draft, PROMPT, sampled, samples=samples,
                                 num_draft_tokens=2, seed=0)
        return {"p_value": result.p_value, "statistic": result.statistic, "dof": result.dof,
                "acceptance": result.acceptance_rate}
    raise ValueError(f"unknown scenario {scenario}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--sharding", default="auto")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mtp-target", help="the target of mtp_greedy (default: --target)")
    parser.add_argument("--mtp-weights", help="the MTP weights of mtp_greedy's target")
    parser.add_argument("--then-mismatch", metavar="PATH",
                        help="afterwards, load again with rank 1 given this target instead")
    parser.add_argument("scenarios", nargs="*")
    args = parser.parse_args()
    from mlx_spec.distributed import launched_group, load_sharded

    group = launched_group()
    rank = group.rank() if group is not None else -1
    if args.scenarios == ["hang"]:  # a launch that never ends: the test must clean it up
        time.sleep(600)
    result = {"size": group.size() if group is not None else 1}
    try:
        target, _, draft = load_sharded(args.target, args.draft, sharding=args.sharding)
        for scenario in args.scenarios:
            if scenario == "mtp_greedy" and args.mtp_target:
                mtp_target = load_sharded(args.mtp_target, sharding=args.sharding)[0]
                result[scenario] = run(scenario, mtp_target, None, args.mtp_weights)
            else:
                result[scenario] = run(scenario, target, draft, args.mtp_weights)
        if args.then_mismatch:  # a wrong launch: the ranks were given different targets
            try:
                load_sharded(args.then_mismatch if rank == 1 else args.target, args.draft)
            except ValueError as exc:
                result["mismatch"] = str(exc)
    except ValueError as exc:  # the one-sentence errors the tests expect
        result["error"] = str(exc)
    except Exception:
        result["crash"] = traceback.format_exc()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    return 0 if "crash" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
