"""Reproducible bench run: fixed seed, results named after the machine, under bench/results/.

    python bench/run_bench.py              # full run on the shipped pair (a real Mac)
    python bench/run_bench.py --quick      # a few minutes
    python bench/run_bench.py --model T --draft-model D

Writes bench/results/<chip>-<quick|full>.json and .md (and PNGs when
matplotlib is installed); every other flag goes to `mlx-spec bench`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mlx_spec.bench.cli import bench
from mlx_spec.bench.machine import chip_name

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_SEED = "0"


def main(argv):
    chip = re.sub(r"[^A-Za-z0-9]+", "-", chip_name()).strip("-").lower() or "machine"
    mode = "quick" if "--quick" in argv else "full"
    args = list(argv)
    if "--json" not in args:
        args += ["--json", str(RESULTS_DIR / f"{chip}-{mode}.json")]
    if "--seed" not in args:
        args += ["--seed", DEFAULT_SEED]
    bench.main(args=args, prog_name="bench/run_bench.py")


if __name__ == "__main__":
    main(sys.argv[1:])
