"""Is mlx-spec ever behind plain decoding or mlx-lm's best fixed k? One table over the pair zoo.

    python bench/never_behind.py                 # every pair, T = 0 / 0.7 / 1
    python bench/never_behind.py --quick         # one repeat, fewer k and temperatures
    python bench/never_behind.py --pairs weak,strong --temps 0 --repeats 5
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/never_behind.py             # the same with OpenBLAS
    python bench/never_behind.py --rerender bench/results/never-behind-....json

Writes bench/results/never-behind-<machine>-<blas>.json and .md (the BLAS
library MLX actually loaded); progress goes to stderr. What is measured and
how: mlx_spec/bench/never_behind.py. The pairs: mlx_spec/bench/zoo.py.

Time on the 2-core development CPU (netlib BLAS, quiet machine): the full
run (4 pairs x 3 T, 8 table repeats, 3 sweep repeats, 64 tokens, copy task)
took 30 minutes; --quick (one repeat) a few minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK = dict(temps=(0.0, 1.0), ks=(1, 2, 4), repeats=1, sweep_repeats=1, max_tokens=48)


def _floats(text):
    return tuple(float(v) for v in text.split(",") if v)


def _names(text):
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv=None):
    from mlx_spec.bench.never_behind import DEFAULT_PROMPTS, DEFAULT_TEMPS
    from mlx_spec.bench.zoo import ZOO_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=_names, default=ZOO_NAMES,
                        help=f"comma-separated, from {', '.join(ZOO_NAMES)} (default: all)")
    parser.add_argument("--temps", type=_floats, default=DEFAULT_TEMPS,
                        help="comma-separated temperatures (default: 0,0.7,1)")
    parser.add_argument("--ks", type=lambda t: tuple(int(v) for v in t.split(",")),
                        default=None, help="mlx-lm's fixed k to sweep (default: 1..6)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8,
                        help="the table's repeats (default 8: ~93%% intervals for its ratios)")
    parser.add_argument("--sweep-repeats", type=int, default=3,
                        help="repeats of mlx-lm's sweep over k, which only picks k (default 3)")
    parser.add_argument("--prompts", type=_names, default=DEFAULT_PROMPTS,
                        help="names from mlx_spec/bench/prompts.py, one per repeat in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-copy-task", action="store_true")
    parser.add_argument("--no-calibration", action="store_true",
                        help="leave the with-calibration column out")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat, T = 0 and 1, k = 1, 2, 4, 48 tokens")
    parser.add_argument("--out", type=Path, default=None,
                        help="path without suffix (default: bench/results/never-behind-"
                             "<machine>-<blas>)")
    parser.add_argument("--rerender", type=Path, default=None,
                        help="rebuild the Markdown from a saved JSON file and exit")
    return parser.parse_args(argv)


def blas_slug(blas: str) -> str:
    lowered = blas.lower()
    for name in ("openblas", "mkl", "blis", "accelerate", "flexiblas"):
        if name in lowered:
            return name
    return "netlib" if "libblas" in lowered else "blas-unknown"


def default_out(blas: str) -> Path:
    machine = re.sub(r"[^a-z0-9]+", "-", f"{platform.system()}-{platform.machine()}".lower())
    return RESULTS_DIR / f"never-behind-{machine.strip('-')}-{blas_slug(blas)}"


def config_from(args):
    from mlx_spec.bench.never_behind import DEFAULT_KS, NeverBehindConfig

    chosen = dict(temps=args.temps, ks=args.ks or DEFAULT_KS, repeats=args.repeats,
                  sweep_repeats=args.sweep_repeats, max_tokens=args.max_tokens)
    if args.quick:
        chosen.update(QUICK)
    return NeverBehindConfig(prompts=args.prompts, seed=args.seed,
                             copy_task=not args.no_copy_task,
                             calibrate=not args.no_calibration, **chosen)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mlx_spec.bench.never_behind import NeverBehind, measure, render_markdown
    from mlx_spec.bench.serialize import from_dict
    from mlx_spec.bench.zoo import build_zoo

    if args.rerender:
        result = from_dict(NeverBehind, json.loads(args.rerender.read_text()))
        args.rerender.with_suffix(".md").write_text(render_markdown(result))
        print(args.rerender.with_suffix(".md"))
        return 0
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", file=sys.stderr, flush=True)

    try:
        pairs = build_zoo(args.pairs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress(f"built {', '.join(p.name for p in pairs)}")
    result = measure(pairs, config_from(args), progress)
    out = args.out or default_out(result.machine.blas)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result.as_dict(), indent=1))
    markdown = render_markdown(result)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    progress(f"wrote {out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
