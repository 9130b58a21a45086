"""Compare bench JSON files side by side (several Macs, or before/after a change).

    python -m bench.studies.compare_results bench/results/*.json

Prints one row per file: machine, BLAS, bandwidth, draft cost, verify cost at
k+1, acceptance at T=0, measured speed-ups and the recommended k. Reads
`mlx-spec bench` JSON files; another study's JSON is skipped with a line on
stderr. Writes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlx_spec.costmodel import interpolate

COLUMNS = ("file", "chip", "device", "read GB/s", "draft cost", "verify(k+1)", "acc T=0",
           "spec/target T=0", "spec/mlx-lm T=0", "best k T=0")


BENCH_KEYS = ("config", "machine", "bandwidth", "target", "draft", "end_to_end", "verdicts")


def row(path: Path, d: dict) -> list:
    k = d["config"]["num_draft_tokens"]
    target, draft = d["target"], d["draft"]
    e2e = {c["temp"]: c["ratios"] for c in d["end_to_end"]}.get(0.0, {})
    verdict = next((v for v in d["verdicts"] if v["temp"] == 0.0), {})
    verify = interpolate({int(t): c for t, c in target["verify_cost"].items()}, k + 1)
    return [
        path.stem, d["machine"]["chip"], d["machine"]["mlx_device"],
        f"{d['bandwidth']['read_gbs']:.1f}", f"{draft['decode_s'] / target['decode_s']:.2f}",
        f"{verify:.2f}",
        f"{verdict.get('acceptance', 0):.0%}",
        f"{e2e.get('mlx-spec / target alone', 0):.2f}x",
        f"{e2e.get('mlx-spec / mlx-lm speculative', 0):.2f}x",
        str(verdict.get("best_k", "-")),
    ]


def main(paths):
    if paths[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if not paths:
        sys.exit("usage: python -m bench.studies.compare_results RESULT.json [RESULT.json ...]")
    table = [list(COLUMNS)]
    for p in map(Path, paths):
        d = json.loads(p.read_text())
        if isinstance(d, dict) and all(key in d for key in BENCH_KEYS):
            table.append(row(p, d))
        else:  # another study's results (never_behind, serve_load, ...): not comparable here
            print(f"skipped {p}: not an `mlx-spec bench` result", file=sys.stderr)
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main(sys.argv[1:])
