"""`mlx-spec bench`: is speculation worth it on this machine, with these models, and why?

Measures the machine (chip, device, BLAS, memory bandwidth), each model's
decoding cost and verify-cost curve, acceptance over k and temperature, the
end-to-end tokens/s of the target alone, mlx-lm's speculative mode and
mlx-spec side by side, the cost model's prediction and recommended k, and
how the speed-up scales with k, temperature, context, target size and batch.

    from mlx_spec.bench import run_bench, quick_config
    result = run_bench(target_model, draft_model, tokenizer, quick_config())

Modules are named after what they measure; `runner` orders them, `report`
and `plots` present them, `cli` is the command line. `calibrate` measures
the per-machine costs that mlx_spec.calibration stores (`mlx-spec tune`).
The standalone studies live outside the package, in the repository's
bench/studies/ (`python -m bench.studies.<name>` from its root). Imports
point down into the rest of the package, never back. The names below are
imported from `runner` on first use, so `mlx-spec --help` imports no MLX.
"""

from importlib import import_module

__all__ = ["BenchConfig", "BenchResult", "quick_config", "run_bench", "tiny_config"]


def __getattr__(name):
    """Import a public name from `runner` on first use (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(".runner", __name__), name)
    globals()[name] = value
    return value
