"""Standalone studies: one question each, one command each, run from the repository root.

    python -m mlx_spec.bench.studies.<name> [--help]

never_behind, mtp_speed, multiturn_reuse, dflash_acceptance, dflash_cost, lookup_track_record,
off_switch, rewind_cost, round_overhead, serve_load,
verify_cost_dtype, distributed_one_process, compare_results and run_bench
(`mlx-spec bench` with a fixed seed and a file name per machine). Those that
write files write them under RESULTS_DIR, `bench/results` relative to the
current directory: the repository's own bench/results/ when run from its
root, which bench/README.md lists file by file. `mlx-spec bench` itself
(mlx_spec/cli/bench.py) needs none of this package.
"""

from pathlib import Path

RESULTS_DIR = Path("bench") / "results"
