"""Verify-cost curves: the time of one forward over T tokens relative to T = 1, by model and
weight format, on this machine's BLAS.

    python -m bench.studies.verify_cost_dtype
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m bench.studies.verify_cost_dtype

Drafting pays only where verifying k + 1 tokens costs much less than k + 1 single passes; this
shows where that holds on MLX's Linux CPU backend: the shipped target in float16 (as shipped:
no BLAS) and float32 (BLAS), and the real models of the real_models study (GGUF files in
$MLX_SPEC_REAL_MODELS or ~/.cache/mlx-spec/real-models; `make real-models`) as loaded
(quantized matrices in MLX's quantized format) and dequantized to float32 (`--dequantize`).
Interleaved medians (`forward_seconds`) after a 256-token prefix. Writes
bench/results/verify-cost-<blas>.json and .md (--out another name).
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from . import study_header, write_results
from .never_behind import blas_slug
from .real_models import MODELS, models_root

LENGTHS = (1, 2, 4, 8, 16)
CONTEXT = 256


def configurations(names):
    """(name, weights, loader) for every model asked for that is here."""
    from mlx_spec import load

    def shipped(dtype):
        def loader():
            model, _ = load()
            model.set_dtype(dtype)
            return model
        return loader

    def real(path, dequantize):
        return lambda: load(str(path), **({"dequantize": True, "dtype": "float32"}
                                          if dequantize else {}))[0]

    for name in names:
        if name == "shipped":
            yield name, "float16 (as shipped)", shipped(mx.float16)
            yield name, "float32", shipped(mx.float32)
            continue
        path = models_root() / MODELS[name]
        if not path.exists():
            print(f"{name}: {path} is not here (make real-models); skipped", file=sys.stderr)
            continue
        yield name, "as loaded (quantized)", real(path, False)
        yield name, "dequantized, float32", real(path, True)


def main(argv=None) -> int:
    from mlx_spec.bench.forward import forward_seconds, prefilled_cache
    from mlx_spec.bench.machine import blas_library

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="shipped,smollm2,gemma3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    unknown = [n for n in args.models.split(",") if n != "shipped" and n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from shipped, {', '.join(MODELS)}.")
    blas = blas_library()
    rows = []
    for name, weights, loader in configurations(args.models.split(",")):
        model = loader()
        seconds = forward_seconds(model, prefilled_cache(model, CONTEXT), LENGTHS,
                                  repeats=args.repeats)
        rows.append({"model": name, "weights": weights, "one_ms": round(seconds[1] * 1e3, 1),
                     "curve": {t: round(seconds[t] / seconds[1], 2) for t in LENGTHS}})
        print(f"{name} {weights}: " + "  ".join(f"T={t}: {rows[-1]['curve'][t]:.2f}"
                                                for t in LENGTHS), file=sys.stderr)
        del model
        mx.clear_cache()
    header = study_header("verify_cost_dtype", argv, repeats=args.repeats, context=CONTEXT)
    lines = ["# Verify-cost curves: one forward over T tokens / one over 1 token", "",
             f"`{header['command']}`", "", f"Machine: {header['machine']}. Interleaved medians "
             f"of {args.repeats} repeats after a {CONTEXT}-token prefix.", "",
             "| model | weights | T = 1 | " + " | ".join(f"T = {t}" for t in LENGTHS[1:]) + " |",
             "|---|---|---|" + "---|" * (len(LENGTHS) - 1)]
    lines += [f"| {r['model']} | {r['weights']} | {r['one_ms']} ms | "
              + " | ".join(f"{r['curve'][t]:.2f}" for t in LENGTHS[1:]) + " |" for r in rows]
    write_results(args.out or f"verify-cost-{blas_slug(blas)}", header, rows,
                  "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
