"""Reproducible bench run: fixed seed, results named after the machine, under bench/results/.

    python -m bench.studies.run_bench            # full run, the shipped pair
    python -m bench.studies.run_bench --quick    # a few minutes
    python -m bench.studies.run_bench --model T --draft-model D

Run from the repository root: writes bench/results/<chip>-<quick|full>.json
and .md (and PNGs when matplotlib is installed) unless --json says where;
every other flag goes to `mlx-spec bench`.
"""

from __future__ import annotations

import re
import subprocess
import sys

from mlx_spec.calibration.machine import chip_name
from . import RESULTS_DIR

DEFAULT_SEED = "0"


def main(argv):
    chip = re.sub(r"[^A-Za-z0-9]+", "-", chip_name()).strip("-").lower() or "machine"
    mode = "quick" if "--quick" in argv else "full"
    args = list(argv)
    if "--json" not in args:
        args += ["--json", str(RESULTS_DIR / f"{chip}-{mode}.json")]
    if "--seed" not in args:
        args += ["--seed", DEFAULT_SEED]
    # The command itself, as a user runs it (the command line sits above the bench package).
    sys.exit(subprocess.run([sys.executable, "-m", "mlx_spec", "bench", *args]).returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
