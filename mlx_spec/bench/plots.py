"""PNG plots of a bench result: speed-up vs k, verify-cost curve, scaling.

matplotlib is an optional extra (`pip install mlx-spec[plots]`); without it
`write_plots` writes nothing and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

from .runner import BenchResult


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _speedup_vs_k(ax, r: BenchResult):
    for v in r.verdicts:
        ks = sorted(v.predicted_by_k)
        ax.plot(ks, [v.predicted_by_k[k] for k in ks], "--o", label=f"predicted T={v.temp:g}")
    ks = sorted(r.speedup_vs_k)
    ax.plot(ks, [r.speedup_vs_k[k] for k in ks], "-s", color="black", label="measured T=0")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="k (drafted tokens per round)", ylabel="speed-up over target alone",
           title="Speed-up vs k")
    ax.legend()


def _verify_cost(ax, r: BenchResult):
    for cost in filter(None, (r.target, r.draft)):  # no draft curve for a block drafter
        ts = sorted(cost.verify_cost)
        ax.plot(ts, [cost.verify_cost[t] for t in ts], "-o", label=cost.role)
    ts = sorted(r.target.verify_cost)
    ax.plot(ts, ts, ":", color="grey", label="linear (compute-bound)")
    ax.set(xscale="log", yscale="log", xlabel="T (tokens in one forward)",
           ylabel="time / time(T=1)", title="Verify-cost curve")
    ax.legend()


def _scaling(axes, r: BenchResult):
    ctx, size, batch = axes
    ctx.plot([p.context_length for p in r.context_scaling],
             [p.predicted_speedup for p in r.context_scaling], "-o")
    ctx.set(xscale="log", xlabel="context length", ylabel="predicted speed-up",
            title="Context length")
    size.plot([p.weight_bytes / 1e6 for p in r.size_scaling],
              [p.predicted_speedup for p in r.size_scaling], "-o")
    size.set(xscale="log", xlabel="target weights (MB, synthetic)", ylabel="predicted speed-up",
             title="Target size")
    points = r.batch_scaling.points
    batch.plot([p.batch for p in points], [p.relative_cost for p in points], "-o",
               label="measured")
    batch.plot([p.batch for p in points], [p.batch for p in points], ":", color="grey",
               label="linear")
    batch.set(xscale="log", yscale="log", xlabel="batch size B",
              ylabel="time / time(B=1)", title=f"Batch ({r.batch_scaling.tokens_per_row} tok/row)")
    batch.legend()


def write_plots(r: BenchResult, stem: Path) -> Tuple[List[Path], str]:
    """Write `<stem>-speedup.png`, `-verify.png`, `-scaling.png`; return (paths, message)."""
    if not available():
        return [], "matplotlib is not installed (pip install 'mlx-spec[plots]'); no plots."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for suffix, draw, ncols in (("speedup", _speedup_vs_k, 1), ("verify", _verify_cost, 1),
                                ("scaling", _scaling, 3)):
        fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4))
        draw(axes, r)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{suffix}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths, f"Wrote {len(paths)} plots."
