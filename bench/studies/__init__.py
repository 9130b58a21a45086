"""Standalone studies: one question each, one command each, run from the repository root.

    python -m bench.studies.<name> [--help]

never_behind, k_choice, plain_loop, mtp_speed, multiturn_reuse, dflash_acceptance,
eagle3_acceptance, dflash_cost, dflash_reference, lookup_track_record, off_switch,
copy_ceiling, tree_vs_chain, suffix_traces, rewind_cost, round_overhead, serve_load, serve_abuse,
verify_cost_dtype, sampled_rule_cost, distributed_one_process, real_models, cross_tokenizer, gguf_fidelity,
real_model_exactness, compare_results and run_bench (`mlx-spec bench` with a
fixed seed and a file name per machine). They import the installed package (`mlx_spec`) and the pair zoo
(bench/zoo.py); the package imports none of them, and the wheel does not hold them. Those that
write files write them under RESULTS_DIR, `bench/results` relative to the current directory:
the repository's own bench/results/ when run from its root, which bench/README.md lists file
by file.
"""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

RESULTS_DIR = Path("bench") / "results"


def study_header(module: str, argv, **fields) -> dict:
    """The command (as typed) and machine line every results file opens with, plus `fields`."""
    from mlx_spec.bench.machine import machine_info
    info = machine_info()
    return {"command": f"python -m bench.studies.{module} "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{info.chip}, BLAS {info.blas}, MLX {info.mlx_version}", **fields}


def write_results(out: str, header: dict, rows: list, markdown: str) -> None:
    """bench/results/<out>.json (header and rows) and .md; the Markdown is printed too."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{out}.json").write_text(json.dumps({**header, "rows": rows}, indent=1))
    (RESULTS_DIR / f"{out}.md").write_text(markdown)
    print(markdown)


def paired_ratio(over, under) -> dict:
    """{median, low, high, coverage} of the per-repeat ratios over[i] / under[i]: their median
    and its order-statistics interval (mlx_spec.bench.timing.median_interval)."""
    from mlx_spec.bench.timing import median, median_interval

    ratios = [a / b for a, b in zip(over, under)]
    low, high, coverage = median_interval(ratios)
    return {"median": median(ratios), "low": low, "high": high, "coverage": coverage}


def check_pairs(parser, names: str, known) -> None:
    """Refuse (argparse's one-sentence error, exit 2) the first of the comma-separated
    `names` not among `known`."""
    unknown = [name for name in names.split(",") if name not in known]
    if unknown:
        parser.error(f"unknown pair {unknown[0]!r}; choose from {', '.join(known)}.")


@contextmanager
def constants(owner, **values):
    """`owner`'s attributes (a module's constants, a class's methods) set to `values` while the
    block runs, then put back, whatever happens in it."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def parse_temps(parser, text: str) -> list:
    """The comma-separated temperatures of `--temps`, or argparse's one-sentence error (exit 2)
    when one is not a number or is negative."""
    try:
        temps = [float(t) for t in text.split(",")]
    except ValueError:
        parser.error(f"--temps takes numbers separated by commas, got {text!r}.")
    if min(temps) < 0:
        parser.error("--temps must be >= 0.")
    return temps
